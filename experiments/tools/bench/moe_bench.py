"""The MoE block against a plain PyTorch MoE loop, and a MoE model's training step (issue 24).

Two measurements, one invocation:
- layer: one MoE MLP at the preset's shape (`model.moe`: E experts of F, top-k, shared experts)
  forward + backward on [seq, micro_batch, d_model], two implementations on the same weights
  and tokens:
  * `framework`: `trainer.model.moe.MoE`, dropless: assignments sorted by expert, one grouped
    matmul per projection (`torch._grouped_mm` on CUDA in bf16, else a loop over the sorted
    slices), routing and balance losses included;
  * `plain`: the loop most MoE code starts from: for each expert, `nonzero` on the routing mask,
    gather its tokens, SwiGLU, `index_add_` the weighted output (Mixtral's reference style);
  ms per call and TFLOP/s by the active FLOPs (6 x tokens x (k + shared) x 3 d F, the router's
  6 x tokens x E d), and the outputs' max difference (the two compute the same function);
- step: the whole MoE model (`trainer.model.llama.Llama`, fused AdamW, one process: ep = 1; on
  CUDA bf16 parameters without autocast, as the trainer runs them, so that the experts take the
  grouped GEMM), `--steps` steps after `--warmup`; tokens/s and MFU = tokens/s x
  `trainer.model.flops.flops_per_token` (active parameters: 6 N_active + attention) / 989e12.

On CUDA times are CUDA-event spans over back-to-back calls; on the CPU wall time (a smoke run,
not a result). Expert parallelism is measured by the trainer itself under torchrun
(`parallelism.ep`), not here.

Usage (repository root):
    python experiments/tools/bench/moe_bench.py [--preset moe-1b-active] [--micro-batch 4] [--seq 2048] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.schema import ModelConfig, apply_preset  # noqa: E402
from trainer.config.tools import from_dict  # noqa: E402
from trainer.model.init import init_parameters  # noqa: E402
from trainer.model.moe import MoE, set_global_batch  # noqa: E402
from trainer.parallel.tensor import TensorParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import add_model_args, bench_args, layer_and_step, model_step_row, timed  # noqa: E402


def model_config(preset: str) -> ModelConfig:
    raw = {"model": {"preset": preset}}
    apply_preset(raw)
    cfg = from_dict(ModelConfig, raw["model"], "model")
    if cfg.moe is None:
        raise SystemExit(f"--preset {preset}: not a MoE preset (no model.moe)")
    return cfg


def plain_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert mask-and-gather loop on `moe`'s weights (same routing, no auxiliary losses)."""
    cfg = moe.moe
    s, b, d = x.shape
    flat = x.reshape(-1, d)
    logits = F.linear(flat, moe.router.weight).float()
    probs = logits.softmax(-1)
    top, experts = probs.topk(cfg.top_k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True) if cfg.normalize_top_k else top).to(x.dtype)
    out = torch.zeros_like(flat)
    for e in range(cfg.num_experts):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = flat[token] @ moe.experts.gate_up[e].t()
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ moe.experts.down[e].t()
        out.index_add_(0, token, y * weights[token, slot, None])
    if moe.shared is not None:
        gate, up = moe.shared["gate_up"](flat).chunk(2, dim=-1)
        out = out + moe.shared["down"](F.silu(gate) * up)
    return out.view(s, b, d)


def active_flops(cfg: ModelConfig, tokens: int) -> float:
    moe = cfg.moe
    f = moe.ffn_dim(cfg.ffn_dim)
    return 6.0 * tokens * ((moe.top_k + moe.shared_experts) * 3 * cfg.d_model * f + moe.num_experts * cfg.d_model)


def bench_layer(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    moe = MoE(cfg, TensorParallel(), device=device)
    init_parameters(torch.nn.ModuleDict({"mlp": moe}), cfg, 0, 0, 1)
    moe.to(dtype)
    set_global_batch(moe, args.micro_batch)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.seq, args.micro_batch, cfg.d_model, generator=gen).to(device, dtype).requires_grad_()
    with torch.no_grad():
        diff = (moe(x) - plain_moe(moe, x)).abs().max().item()
    rows = []
    for label, fn in (("framework", moe), ("plain", lambda t: plain_moe(moe, t))):

        def call(fn=fn):
            fn(x).float().square().mean().backward()

        secs = sorted(timed(call, args.steps, args.warmup, device))
        median = secs[len(secs) // 2]
        flops = active_flops(cfg, args.seq * args.micro_batch)
        rows.append({"part": "layer", "variant": label, "ms": median * 1e3, "tflops": flops / median / 1e12})
    speedup = rows[1]["ms"] / rows[0]["ms"]
    rows[0].update(speedup_vs_plain=speedup, max_abs_diff=diff)
    return rows


def bench_step(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> dict:
    """The trainer's GPU precision: parameters (not buffers) in `dtype`, no autocast (what
    `trainer.optim.master_weights` leaves the model with), so that the experts take
    `torch._grouped_mm`, which needs bf16 weights: fp32 parameters under autocast would time
    the loop over slices instead."""
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    model = Llama(cfg, pc=ParallelContext.single(device)).to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    set_global_batch(model, args.micro_batch)
    return model_step_row(model, cfg, args.preset, args.micro_batch, args.seq, args.steps, args.warmup, device, dtype)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "moe-1b-active")
    args, device, dtype = bench_args(ap, argv)
    cfg = model_config(args.preset)
    return layer_and_step(bench_layer, bench_step, cfg, args, device, dtype, "moe_bench.json")


if __name__ == "__main__":
    main()
