"""The Mamba-2 mixer and a hybrid model's training step, timed (issue 25).

Two measurements, one invocation:
- layer: one Mamba-2 mixer (`trainer.model.mamba.mixer.Mamba2Mixer`, the preset's shape) forward +
  backward on [seq, micro_batch, d_model], eager and under `torch.compile` (the chunked scan of
  `trainer.model.mamba.ssd` in plain PyTorch, compiled); ms per call and TFLOP/s by the counted FLOPs
  (in/out projections as 2 x params x tokens, the scan as `ssd_flops_per_token`; x3 for
  forward + backward);
- step: the whole hybrid model (`trainer.model.llama.Llama`, `model.compile` on CUDA, bf16
  autocast, fused AdamW) for `--steps` steps after `--warmup`; tokens/s and MFU = tokens/s x
  `trainer.model.flops.flops_per_token` / 989e12 (the H200's bf16 datasheet peak): 6 N + 6 d s
  per attention layer (causal half) + the scan per Mamba-2 layer, model FLOPs without recompute.

On CUDA times are CUDA-event spans over back-to-back calls (one sync at the end); on the CPU
wall time (a smoke run, not a result).

Usage (repository root):
    python experiments/tools/bench/mamba_bench.py [--preset hybrid-1b] [--micro-batch 4] [--seq 2048] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--no-compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.mamba import ssd_flops_per_token  # noqa: E402
from trainer.config.schema import ModelConfig, apply_preset  # noqa: E402
from trainer.config.tools import from_dict  # noqa: E402
from trainer.model.init import init_parameters  # noqa: E402
from trainer.model.mamba.mixer import Mamba2Mixer  # noqa: E402
from trainer.parallel.tensor import TensorParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import add_model_args, model_step_row, run_part, timed  # noqa: E402


def model_config(preset: str, compile: bool) -> ModelConfig:
    raw = {"model": {"preset": preset, "compile": compile}}
    apply_preset(raw)
    return from_dict(ModelConfig, raw["model"], "model")


def mixer_flops(cfg: ModelConfig, tokens: int) -> float:
    m, d = cfg.mamba, cfg.d_model
    di, bc, heads = m.d_inner(d), m.ngroups * m.d_state, m.n_heads(d)
    return tokens * (3 * 2 * (d * (2 * di + 2 * bc + heads) + di * d) + ssd_flops_per_token(cfg))


def bench_layer(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    mixer = Mamba2Mixer(cfg, TensorParallel(), device=device)
    init_parameters(torch.nn.ModuleDict({"mamba": mixer}), cfg, 0, 0, 1)  # the names init reads
    mixer.to(dtype)
    x = torch.randn(args.seq, args.micro_batch, cfg.d_model, device=device, dtype=dtype, requires_grad=True)
    rows = []
    variants = [("eager", mixer)] + ([("compiled", torch.compile(mixer, dynamic=False))] if args.compile else [])
    for label, fn in variants:

        def call(fn=fn):
            fn(x).float().square().mean().backward()

        secs = sorted(timed(call, args.steps, args.warmup, device))
        median = secs[len(secs) // 2]
        flops = mixer_flops(cfg, args.seq * args.micro_batch)
        rows.append({"part": "layer", "variant": label, "ms": median * 1e3, "tflops": flops / median / 1e12})
    return rows


def bench_step(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> dict:
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    model = Llama(cfg, pc=ParallelContext.single(device))
    return model_step_row(model, cfg, args.preset, args.micro_batch, args.seq, args.steps, args.warmup, device, dtype)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "hybrid-1b")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(args.preset, args.compile and device.type == "cuda")
    rows: list[dict] = []
    ok = run_part(rows, "layer", lambda: bench_layer(cfg, args, device, dtype))
    ok &= run_part(rows, "step", lambda: [bench_step(cfg, args, device, dtype)])
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mamba_bench.json").write_text(text)
    if not ok:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
