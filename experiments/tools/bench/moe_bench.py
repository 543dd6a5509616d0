"""The MoE block against a plain PyTorch MoE loop, and a MoE model's training step (issues 24, 37).

Two measurements, one invocation:
- layer: one MoE MLP at the preset's shape (`model.moe`: E experts of F, top-k, shared experts)
  forward + backward on [seq, micro_batch, d_model], on the same weights and tokens:
  * `framework`: `trainer.model.moe.MoE`, dropless: assignments sorted by expert, one grouped
    matmul per projection (`torch._grouped_mm` on CUDA in bf16, else a loop over the sorted
    slices), routing and balance losses included;
  * `plain`: the loop most MoE code starts from: for each expert, `nonzero` on the routing mask,
    gather its tokens, SwiGLU, `index_add_` the weighted output (Mixtral's reference style);
  each eager and, unless --no-compile, compiled (`torch.compile`; inductor on CUDA, `aot_eager`
  on the CPU; the plain loop's `nonzero` is a graph break inside its loop, so dynamo runs the
  loop itself eagerly and compiles only the routing, per-expert and shared pieces it calls:
  its compiled row says so in `note`). Rows in pairs, eager then compiled; ms per call, TFLOP/s
  by the active FLOPs (6 x tokens x (k + shared) x 3 d F, the router's 6 x tokens x E d), each
  framework row's `speedup_vs_plain` against the plain row of the same mode (eager vs eager,
  compiled vs compiled), the compiled rows' graph breaks and graphs, and the outputs' max
  difference. Which GEMMs ran is counted, not derived: every row's `grouped_mm_calls` and
  `mm_calls` are the `aten::_grouped_mm` and `aten::mm` calls the profiler saw in one more
  forward + backward of that very variant (compiled graphs' kernel calls included), and
  `grouped_mm` is whether the first is positive;
- step: the whole MoE model (`trainer.model.llama.Llama`, fused AdamW, one process: ep = 1; on
  CUDA bf16 parameters without autocast, as the trainer runs them, so that the experts take the
  grouped GEMM), eager and, on CUDA, with `model.compile` (the trainer's compile: the stage as
  one graph), `--steps` steps after `--warmup`; tokens/s, MFU = tokens/s x
  `trainer.model.flops.flops_per_token` (active parameters: 6 N_active + attention) / 989e12,
  the compiled step's graph breaks, and the GEMM calls of one more forward + backward, counted
  as for the layer.
With `--profile`, each layer row's kernels (a torch.profiler table by total device time) are
written to `moe_profile.txt` under --out.

On CUDA times are CUDA-event spans over back-to-back calls; on the CPU wall time (a smoke run,
not a result). Expert parallelism is measured by the trainer itself under torchrun
(`parallelism.ep`), not here.

Usage (repository root):
    python experiments/tools/bench/moe_bench.py [--preset moe-1b-active] [--micro-batch 4] [--seq 2048] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--no-compile] [--profile] \\
        [--parts layer,step,step-compiled] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.moe import moe_mlp_params  # noqa: E402
from trainer.config.schema import ModelConfig, model_config  # noqa: E402
from trainer.model.init import init_parameters  # noqa: E402
from trainer.model.moe import MoE, set_global_batch  # noqa: E402
from trainer.parallel.tensor import TensorParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import add_model_args, bench_args, model_step_row, run_parts, timed  # noqa: E402


def moe_model_config(preset: str) -> ModelConfig:
    cfg = model_config(preset=preset)
    if cfg.moe is None:
        raise SystemExit(f"--preset {preset}: not a MoE preset (no model.moe)")
    return cfg


def plain_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert mask-and-gather loop on `moe`'s weights (same routing, no auxiliary losses).
    Its pieces are functions so that under torch.compile, which runs this loop eagerly (a graph
    break at `nonzero` inside a loop skips the frame), each piece still compiles."""
    s, b, d = x.shape
    flat = x.reshape(-1, d)
    weights, experts = _plain_route(moe, flat)
    out = torch.zeros_like(flat)
    for e in range(moe.moe.num_experts):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        _plain_expert(moe, flat, out, e, token, weights[token, slot, None])
    if moe.shared is not None:
        out = _plain_shared(moe, flat, out)
    return out.view(s, b, d)


def _plain_route(moe: MoE, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = moe.moe
    probs = F.linear(flat, moe.router.weight).float().softmax(-1)
    top, experts = probs.topk(cfg.top_k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if cfg.normalize_top_k else top).to(flat.dtype), experts


def _plain_expert(
    moe: MoE, flat: torch.Tensor, out: torch.Tensor, e: int, token: torch.Tensor, weight: torch.Tensor
) -> None:
    gate, up = (flat[token] @ moe.experts.gate_up[e].t()).chunk(2, dim=-1)
    out.index_add_(0, token, ((F.silu(gate) * up) @ moe.experts.down[e].t()) * weight)


def _plain_shared(moe: MoE, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    gate, up = moe.shared["gate_up"](flat).chunk(2, dim=-1)
    return out + moe.shared["down"](F.silu(gate) * up)


def active_flops(cfg: ModelConfig, tokens: int) -> float:
    return 6.0 * tokens * moe_mlp_params(cfg, active=True)


def graph_breaks() -> int:
    """Dynamo's graph breaks since the last `fresh_dynamo()`."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def dynamo_frames() -> dict:
    """Since the last `fresh_dynamo()`: the graphs dynamo compiled and the Python frames it
    skipped (ran eagerly: a graph break inside a loop skips its whole frame)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {"graphs": counters["stats"]["unique_graphs"], "frames_skipped": frames["total"] - frames["ok"]}


def fresh_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def compiled(fn, device: torch.device):
    """`fn` under torch.compile as the trainer compiles (inductor) on CUDA; `aot_eager` on the CPU,
    where the smoke run only needs the graphs and their breaks. Dynamo starts afresh, so that
    the counters read after its calls are this variant's."""
    fresh_dynamo()
    return torch.compile(fn, dynamic=False, backend="inductor" if device.type == "cuda" else "aot_eager")


def gemm_calls(call, device: torch.device) -> tuple[dict, str]:
    """One profiled `call()`: the `aten::_grouped_mm` and `aten::mm` calls it made, forward and
    backward, compiled graphs' kernel calls included (the path the code took, as it ran), and
    its profiler table by total device time. An `mm` inside a `_grouped_mm` (the CPU kernel is
    a loop of them) is the grouped kernel's, not counted."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    grouped = sum(e.name == "aten::_grouped_mm" for e in prof.events())
    mm = sum(e.name == "aten::mm" and not _inside(e, "aten::_grouped_mm") for e in prof.events())
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    counts = {"grouped_mm": grouped > 0, "grouped_mm_calls": grouped, "mm_calls": mm}
    return counts, prof.key_averages().table(sort_by=key, row_limit=30)


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


#: What a compiled row says when dynamo ran a frame of it eagerly.
SKIPPED_NOTE = (
    "dynamo skipped {n} frame(s) and ran them eagerly (a graph break inside a loop, here `nonzero`"
    " in the per-expert loop, skips the whole frame); the functions they call compiled on their own"
)


def bench_layer(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Rows in pairs of one mode, framework then plain: eager, then compiled (module docstring)."""
    moe = MoE(cfg, TensorParallel(), device=device)
    init_parameters(torch.nn.ModuleDict({"mlp": moe}), cfg, 0, 0, 1)
    moe.to(dtype)
    set_global_batch(moe, args.micro_batch)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.seq, args.micro_batch, cfg.d_model, generator=gen).to(device, dtype).requires_grad_()
    with torch.no_grad():
        diff = (moe(x) - plain_moe(moe, x)).abs().max().item()
    variants = [("framework", moe), ("plain", lambda t: plain_moe(moe, t))]
    rows, tables = [], []
    for is_compiled in (False, True) if args.compile else (False,):
        pair = []
        for label, fn in variants:
            row, table = layer_row(
                label, compiled(fn, device) if is_compiled else fn, is_compiled, x, cfg, args, device
            )
            if label == "framework":
                row["max_abs_diff"] = diff
            pair.append(row)
            if table:
                tables.append(f"== {label} {'compiled' if is_compiled else 'eager'}: 1 call\n{table}")
        ours, plain = pair
        if "ms" in ours and "ms" in plain:
            ours["speedup_vs_plain"] = plain["ms"] / ours["ms"]
        rows += pair
    if args.profile and args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_profile.txt").write_text("\n\n".join(tables) + "\n")
    return rows


def layer_row(label: str, fn, is_compiled: bool, x: torch.Tensor, cfg: ModelConfig, args, device) -> tuple[dict, str]:
    """One variant's row (its time, the GEMMs its forward + backward called, a compiled one's
    dynamo counts) and its profiler table; a variant that fails is a row with its error."""

    def call():
        fn(x).float().square().mean().backward()

    row = {"part": "layer", "variant": label, "compiled": is_compiled}
    try:
        secs = sorted(timed(call, args.steps, args.warmup, device))
        counts, table = gemm_calls(call, device)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row; the others still run
        return {**row, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}, ""
    median = secs[len(secs) // 2]
    row.update(ms=median * 1e3, tflops=active_flops(cfg, args.seq * args.micro_batch) / median / 1e12, **counts)
    if is_compiled:
        frames = dynamo_frames()
        row.update(graph_breaks=graph_breaks(), **frames)
        if frames["frames_skipped"]:
            row["note"] = SKIPPED_NOTE.format(n=frames["frames_skipped"])
    return row, table


def bench_step(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype, compile: bool) -> dict:
    """The trainer's GPU precision: parameters (not buffers) in `dtype`, no autocast (what
    `trainer.optim.master_weights` leaves the model with); the experts take `torch._grouped_mm`
    in bf16 (fp32 parameters under autocast would too: `grouped_swiglu` casts them as autocast
    does). The row's GEMM counts come from one more profiled forward + backward (`gemm_calls`).
    `compile`: `model.compile` (CUDA only, as in the trainer)."""
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    fresh_dynamo()
    model = Llama(dataclasses.replace(cfg, compile=compile), pc=ParallelContext.single(device)).to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    set_global_batch(model, args.micro_batch)
    row = model_step_row(model, cfg, args.preset, args.micro_batch, args.seq, args.steps, args.warmup, device, dtype)
    row = {**row, "compiled": compile, **({"graph_breaks": graph_breaks()} if compile else {})}
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=gen).to(device)
    counts, _ = gemm_calls(lambda: model(None, {"input_ids": ids, "labels": ids}).mean().backward(), device)
    model.zero_grad(set_to_none=True)
    return {**row, **counts}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "moe-1b-active")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parts", default="layer,step,step-compiled", help="comma-separated: which parts run")
    args, device, dtype = bench_args(ap, argv)
    cfg = moe_model_config(args.preset)
    parts = {
        "layer": lambda: bench_layer(cfg, args, device, dtype),
        "step": lambda: [bench_step(cfg, args, device, dtype, False)],
    }
    if args.compile and device.type == "cuda":
        parts["step-compiled"] = lambda: [bench_step(cfg, args, device, dtype, True)]
    wanted = args.parts.split(",")
    unknown = sorted(set(wanted) - {"layer", "step", "step-compiled"})
    if unknown:
        ap.error(f"--parts: expected layer, step or step-compiled, got {', '.join(unknown)}")
    return run_parts({k: v for k, v in parts.items() if k in wanted}, device, args.out, "moe_bench.json")


if __name__ == "__main__":
    main()
