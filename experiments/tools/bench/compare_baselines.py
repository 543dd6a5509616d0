"""`plain_llama.py` against another copy of the plain baseline, on the CPU.

Why: bench runs up to 2026-12-04 timed an external `plain_llama.py` that was copied by hand into
`runs/bench_baseline/`; the in-repository `plain_llama.py` replaced it. This is the record that
the two compute the same step. For each shape both models are built from one seed (the weights
must come out equal); then the other's weights are redrawn (norm weights around 1, matrices at
std 0.05, so that no tensor is trivially equal) and loaded into ours by name, and the logits,
the loss, every gradient and every parameter after one fused AdamW step (lr 1e-4, what both
steps use) are compared. fp32 by default; `--dtype bf16` is the GPU's dtype, without compile.
It needs the other file only when run; nothing else reads it.

The other file's interface is the external baseline's: `Llama(vocab, d, layers, heads,
kv_heads, d_ff, seq)` with parameters `emb`, `blocks.<i>.{n1,n2,qkv,o,gate_up,down}`, `norm`,
`head`, and `forward(ids, targets)` -> the mean loss.

Usage: python experiments/tools/bench/compare_baselines.py --other PATH/plain_llama.py [--preset-280m] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plain_llama  # noqa: E402

#: CPU-sized shapes: grouped-query and plain multi-head attention.
SHAPES = {
    "tiny-gqa": plain_llama.Shape(
        vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=96, seq=32, micro_batch=2
    ),
    "tiny-mha": plain_llama.Shape(
        vocab=300, d_model=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn=160, seq=24, micro_batch=3
    ),
}
LAYER_NAMES = {
    "n1.weight": "attention_norm",
    "n2.weight": "ffn_norm",
    "qkv.weight": "wqkv.weight",
    "o.weight": "wo.weight",
    "gate_up.weight": "w_gate_up.weight",
    "down.weight": "w_down.weight",
}
TOP_NAMES = {"emb.weight": "tok_embeddings.weight", "norm.weight": "final_norm", "head.weight": "output.weight"}


def our_name(theirs: str) -> str:
    """The other baseline's parameter name -> ours."""
    if theirs in TOP_NAMES:
        return TOP_NAMES[theirs]
    _, index, rest = theirs.split(".", 2)
    return f"layers.{index}.{LAYER_NAMES[rest]}"


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("other_plain_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].float() - b[our_name(n)].float()).abs().max().item() for n in a)


def compare(other, shape: plain_llama.Shape, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    torch.manual_seed(0)
    theirs = other.Llama(
        shape.vocab, shape.d_model, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn, shape.seq
    )
    torch.manual_seed(0)
    ours = plain_llama.Llama(shape)
    their_params = dict(theirs.named_parameters())
    out = {"init": max_diff({n: p.detach() for n, p in their_params.items()}, dict(ours.named_parameters()))}
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in their_params.values():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.05) + (p.dim() == 1))
        ours.load_state_dict({our_name(n): p.detach().clone() for n, p in their_params.items()})
    theirs.to(dtype)
    ours.to(dtype)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g)
    targets = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g)
    seen = []
    hook = theirs.head.register_forward_hook(lambda _m, _i, logits: seen.append(logits.detach()))
    their_loss = theirs(ids, targets)
    hook.remove()
    our_loss = ours(ids, targets)
    out["logits"] = (seen[0].float() - ours.logits(ids).float()).abs().max().item()
    out["loss"] = abs(their_loss.item() - our_loss.item())
    out["loss_value"] = our_loss.item()

    their_loss.backward()
    our_loss.backward()
    out["grads"] = max_diff(
        {n: p.grad for n, p in their_params.items()}, {n: p.grad for n, p in ours.named_parameters()}
    )
    torch.optim.AdamW(theirs.parameters(), lr=1e-4, fused=True).step()
    plain_llama.optimizer(ours).step()
    out["after_step"] = max_diff({n: p.detach() for n, p in their_params.items()}, dict(ours.named_parameters()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", type=Path, required=True, help="the other plain_llama.py")
    p.add_argument("--preset-280m", action="store_true", help="also the 280m preset at micro-batch 1 (slow)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameters and activations")
    args = p.parse_args()
    other = load_module(args.other)
    shapes = dict(SHAPES)
    if args.preset_280m:
        shapes["280m (mb 1)"] = replace(plain_llama.PRESETS["280m"], micro_batch=1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"torch={torch.__version__} {args.dtype} CPU; max |ours - other|")
    for name, shape in shapes.items():
        d = compare(other, shape, dtype)
        print(
            f"{name}: init {d['init']:.1e}, logits {d['logits']:.1e}, loss {d['loss']:.1e} "
            f"(loss {d['loss_value']:.6f}), grads {d['grads']:.1e}, parameters after one AdamW step "
            f"{d['after_step']:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
