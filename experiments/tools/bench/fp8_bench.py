"""FP8 linears against bf16 (issue 23): each linear of a preset, and the whole training step.

Two measurements, one invocation:
- gemm: each of the preset's block linears (qkv, proj, gate_up, down) at [seq x micro_batch]
  tokens, forward + backward (three GEMMs) through `trainer.parallel.tensor.column_parallel_linear`
  / `row_parallel_linear`, in bf16 (`F.linear`) and with `trainer.model.fp8.Fp8Matmul`
  (tensorwise e5m2 gradients, rowwise e4m3); ms per call, TFLOP/s by 6 x tokens x in x out, the
  speedup over bf16, and the relative error of the output and weight gradient against fp32;
- step: the whole model (`trainer.model.llama.Llama`, bf16 autocast over fp32 parameters, fused
  AdamW, one process), with `model.fp8` off and on; tokens/s and MFU = tokens/s x
  `trainer.model.flops.flops_per_token` / 989e12 (the FP8 run counts the same FLOPs: MFU stays
  against the bf16 peak).

On a CUDA device of compute capability >= 8.9 the FP8 GEMMs are `torch._scaled_mm`; elsewhere
the emulation (quantise, upcast, fp32 matmul): on the CPU a smoke run, not a result. The
quantisation (amaxes, casts) is eager: its cost is part of what is measured.

Usage (repository root):
    python experiments/tools/bench/fp8_bench.py [--preset bench-1b] [--micro-batch 4] [--seq 2048] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.fp8 import Fp8Config  # noqa: E402
from trainer.config.schema import ModelConfig  # noqa: E402
from trainer.model.fp8 import COLUMN, ROW, Fp8Matmul, native_fp8  # noqa: E402
from trainer.parallel.tensor import TensorParallel, column_parallel_linear, row_parallel_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import add_model_args, model_config, model_step_row, run_part, timed  # noqa: E402

VARIANTS = {"tensorwise": ("tensorwise", "e5m2"), "rowwise": ("rowwise", "e4m3")}


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """name -> (style, in_features, out_features) of the block's linears."""
    hd = cfg.head_dim
    return {
        "qkv": (COLUMN, cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd),
        "proj": (ROW, cfg.n_heads * hd, cfg.d_model),
        "gate_up": (COLUMN, cfg.d_model, 2 * cfg.ffn_dim),
        "down": (ROW, cfg.ffn_dim, cfg.d_model),
    }


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def bench_gemms(cfg: ModelConfig, args, device: torch.device) -> list[dict]:
    tp = TensorParallel()
    tokens = args.seq * args.micro_batch
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for name, (style, k, n) in linear_shapes(cfg).items():
        fn = column_parallel_linear if style == COLUMN else row_parallel_linear
        x32 = torch.randn(args.seq, args.micro_batch, k, generator=gen).to(device)
        w32 = (torch.randn(n, k, generator=gen) * k**-0.5).to(device)
        g32 = torch.randn(args.seq, args.micro_batch, n, generator=gen).to(device)
        ref_w = w32.clone().requires_grad_()
        ref_y = F.linear(x32, ref_w)
        ref_y.backward(g32)
        x = x32.to(torch.bfloat16).requires_grad_()
        w, g = w32.to(torch.bfloat16).requires_grad_(), g32.to(torch.bfloat16)
        mms = {"bf16": None} | {v: Fp8Matmul(style, tp, *VARIANTS[v]) for v in VARIANTS}
        base_ms = None
        for label, mm in mms.items():

            def call(mm=mm):
                fn(x, w, tp, mm).backward(g)

            secs = sorted(timed(call, args.steps, args.warmup, device))
            ms = secs[len(secs) // 2] * 1e3
            w.grad = None
            y = fn(x, w, tp, mm)
            y.backward(g)
            base_ms = base_ms or ms
            rows.append(
                {
                    "part": "gemm",
                    "linear": name,
                    "shape": [tokens, k, n],
                    "variant": label,
                    "ms": ms,
                    "tflops": 6.0 * tokens * k * n / (ms / 1e3) / 1e12,
                    "speedup_vs_bf16": base_ms / ms,
                    "rel_err_out": rel_err(y.detach(), ref_y.detach()),
                    "rel_err_grad_w": rel_err(w.grad, ref_w.grad),
                }
            )
            w.grad = None
    return rows


def bench_step(cfg: ModelConfig, args, device: torch.device, label: str) -> dict:
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    model = Llama(cfg, pc=ParallelContext.single(device)).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    row = model_step_row(model, cfg, "", args.micro_batch, args.seq, args.steps, args.warmup, device, dtype)
    del row["preset"]
    return {"part": "step", "variant": label, **{k: v for k, v in row.items() if k != "part"}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "bench-1b")
    p.add_argument("--no-step", action="store_true", help="only the GEMMs")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = replace(model_config(args.preset), max_seq_len=max(args.seq, 16))
    rows: list[dict] = []
    ok = run_part(rows, "gemm", lambda: bench_gemms(cfg, args, device))
    if not args.no_step:
        ok &= run_part(rows, "step/bf16", lambda: [bench_step(cfg, args, device, "bf16")])
        for v, (scaling, grad) in VARIANTS.items():
            fp8_cfg = replace(cfg, fp8=Fp8Config(scaling=scaling, grad_dtype=grad))
            ok &= run_part(rows, f"step/{v}", lambda c=fp8_cfg, v=v: [bench_step(c, args, device, v)])
    native = native_fp8(device)
    result = {"preset": args.preset, "device": str(device), "native_fp8": native, "rows": rows}
    print(f"{args.preset} on {device} ({'torch._scaled_mm' if native else 'EMULATED: not a result'})")
    for r in rows:
        if "error" in r:
            print(f"  {r['part']:5s} FAILED: {r['error']}")
            continue
        what = r.get("linear", "step")
        speed = (
            f"{r['tflops']:.1f} TFLOP/s x{r['speedup_vs_bf16']:.2f}" if r["part"] == "gemm" else f"MFU {r['mfu']:.3f}"
        )
        print(f"  {r['part']:5s} {what:8s} {r['variant']:10s} {r['ms']:9.3f} ms  {speed}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_bench.json").write_text(json.dumps(result, indent=1))
    if not ok:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
