"""The Mamba-2 mixer against mamba_ssm's own, and a hybrid model's training step, timed (issues 25, 37).

Two measurements, one invocation:
- layer: one Mamba-2 mixer at the preset's shape, forward + backward on micro_batch x seq tokens,
  eager and under `torch.compile`, each in the same run: ours (`trainer.model.mamba.mixer.
  Mamba2Mixer`) with the PyTorch chunked scan (`kernel torch`, `trainer.model.mamba.ssd`) and,
  where mamba_ssm imports on CUDA, with its Triton `mamba_chunk_scan_combined` (`kernel
  mamba_ssm`), and mamba_ssm's `Mamba2(use_mem_eff_path=False)` (the same unfused path: its
  Triton scan, its gated-norm kernel, F.conv1d or causal-conv1d). ms per call, TFLOP/s by the
  counted FLOPs (in/out projections as 2 x params x tokens, the scan as `ssd_flops_per_token`;
  x3 for forward + backward), and each of ours as a multiple of Mamba2's time (`vs_mamba2`).
  A `check` row: the largest difference between our two scans' outputs on the same weights
  (bf16 on the GPU).
- step: the whole hybrid model (`trainer.model.llama.Llama`, `model.compile` on CUDA, bf16
  autocast, fused AdamW, `model.mamba.kernel` auto) for `--steps` steps after `--warmup`;
  tokens/s and MFU = tokens/s x `trainer.model.flops.flops_per_token` / 989e12 (the H100/H200
  bf16 datasheet peak), with flops_per_token = 6 N (non-embedding parameters) + 6 d s per
  attention layer (causal half) + 3 (Q (G N + H P) + 4 H P N) per Mamba-2 layer (its chunked
  scan: Q chunk, G groups, N state, H heads of P), model FLOPs without recompute.

On CUDA times are CUDA-event spans over back-to-back calls (one sync at the end); on the CPU
wall time (a smoke run, not a result; there only our PyTorch scan runs).

Usage (repository root; the GPU run, with mamba_ssm installed without its CUDA extensions, is in
experiments/notes/PERFORMANCE.md "Mamba-2 on mamba_ssm's kernels"):
    python experiments/tools/bench/mamba_bench.py [--preset hybrid-1b] [--micro-batch 4] [--seq 2048] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--no-compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.mamba import mamba_projection_params, ssd_flops_per_token  # noqa: E402
from trainer.config.schema import ModelConfig, model_config  # noqa: E402
from trainer.model.init import init_parameters  # noqa: E402
from trainer.model.mamba.kernels import load_chunk_scan, mamba1_placeholder, resolve_kernel  # noqa: E402
from trainer.model.mamba.mixer import Mamba2Mixer  # noqa: E402
from trainer.parallel.tensor import TensorParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import add_model_args, bench_args, model_step_row, run_parts, timed  # noqa: E402


def mixer_flops(cfg: ModelConfig, tokens: int) -> float:
    return tokens * (3 * 2 * mamba_projection_params(cfg) + ssd_flops_per_token(cfg))


def with_kernel(cfg: ModelConfig, kernel: str) -> ModelConfig:
    return dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, kernel=kernel))


def our_mixer(cfg: ModelConfig, kernel: str, device: torch.device, dtype: torch.dtype) -> Mamba2Mixer:
    """Our mixer on `kernel`, initialised as the trainer does (seed 0: the same weights per kernel)."""
    cfg = with_kernel(cfg, kernel)
    mixer = Mamba2Mixer(cfg, TensorParallel(), device=device)
    init_parameters(torch.nn.ModuleDict({"mamba": mixer}), cfg, 0, 0, 1)  # the names init reads
    return mixer.to(dtype)


def mamba_ssm_mixer(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    """mamba_ssm's `Mamba2` at our shape on its unfused path (use_mem_eff_path=False: the Triton
    scan, then its gated RMSNorm; the conv F.conv1d or causal-conv1d), or None where it does not
    run (no CUDA, not installed)."""
    if device.type != "cuda" or load_chunk_scan() is None:
        return None
    with mamba1_placeholder():
        from mamba_ssm.modules.mamba2 import Mamba2
    m = cfg.mamba
    return Mamba2(
        d_model=cfg.d_model,
        d_state=m.d_state,
        d_conv=m.d_conv,
        expand=m.expand,
        headdim=m.head_dim,
        ngroups=m.ngroups,
        chunk_size=m.chunk_size,
        use_mem_eff_path=False,
        device=device,
        dtype=dtype,
    )


def layer_rows(label: str, module, x: torch.Tensor, cfg: ModelConfig, args, device: torch.device) -> list[dict]:
    """`module(x)` forward + backward, eager and (with --compile) compiled; a variant that fails
    is a row with its error, so that the others are still measured."""
    rows = []
    variants = [("eager", module)] + ([("compiled", torch.compile(module, dynamic=False))] if args.compile else [])
    for variant, fn in variants:

        def call(fn=fn):
            fn(x).float().square().mean().backward()

        row = {"part": "layer", "impl": label, "variant": variant}
        try:
            secs = sorted(timed(call, args.steps, args.warmup, device))
        except Exception as e:  # noqa: BLE001 - the other variants still run
            rows.append({**row, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
            continue
        median = secs[len(secs) // 2]
        flops = mixer_flops(cfg, args.seq * args.micro_batch)
        rows.append({**row, "ms": median * 1e3, "tflops": flops / median / 1e12})
    return rows


def bench_layer(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Ours on each scan kernel that runs here, mamba_ssm's Mamba2, and the two scans' difference."""
    x = torch.randn(args.seq, args.micro_batch, cfg.d_model, device=device, dtype=dtype, requires_grad=True)
    rows: list[dict] = []
    mixers = {"torch": our_mixer(cfg, "torch", device, dtype)}
    if resolve_kernel("auto", device) == "mamba_ssm":
        mixers["mamba_ssm"] = our_mixer(cfg, "mamba_ssm", device, dtype)
        with torch.no_grad():
            a, b = (mixers[k](x) for k in ("torch", "mamba_ssm"))
        rows.append({"part": "check", "max_abs_diff": (a - b).abs().max().item(), "max_abs": a.abs().max().item()})
    for kernel, mixer in mixers.items():
        rows += layer_rows(f"ours kernel={kernel}", mixer, x, cfg, args, device)
    theirs = mamba_ssm_mixer(cfg, device, dtype)
    if theirs is not None:
        xt = x.detach().transpose(0, 1).contiguous().requires_grad_()
        ref = layer_rows("mamba_ssm Mamba2", theirs, xt, cfg, args, device)
        rows += ref
        ref_ms = {r["variant"]: r["ms"] for r in ref if "ms" in r}
        for r in rows:
            if r.get("impl", "").startswith("ours") and r.get("variant") in ref_ms and "ms" in r:
                r["vs_mamba2"] = r["ms"] / ref_ms[r["variant"]]
    return rows


def bench_step(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> dict:
    """One row: the whole model's step on `model.mamba.kernel` (resolved on the device)."""
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    model = Llama(cfg, pc=ParallelContext.single(device))
    row = model_step_row(model, cfg, args.preset, args.micro_batch, args.seq, args.steps, args.warmup, device, dtype)
    return {**row, "kernel": resolve_kernel(cfg.mamba.kernel, device)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "hybrid-1b")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    args, device, dtype = bench_args(ap, argv)
    cfg = model_config(preset=args.preset, compile=args.compile and device.type == "cuda")
    parts = {
        "layer": lambda: bench_layer(cfg, args, device, dtype),
        "step": lambda: [bench_step(cfg, args, device, dtype)],
    }
    if resolve_kernel("auto", device) == "mamba_ssm":  # the step on our PyTorch scan too
        parts["step kernel=torch"] = lambda: [bench_step(with_kernel(cfg, "torch"), args, device, dtype)]
    return run_parts(parts, device, args.out, "mamba_bench.json")


if __name__ == "__main__":
    main()
