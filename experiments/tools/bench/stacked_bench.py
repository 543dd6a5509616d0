"""M small models trained stacked (`trainer.stacked`) against the same M trained one by one.

Offline mixing methods (RegMix, Liu et al. ICLR 2025; Data Mixing Laws, Ye et al. ICLR 2025)
train hundreds of tiny models; one at a time, each leaves a GPU mostly idle (small matmuls,
launch-bound steps). The target (issue 21): 64 runs of a ~5M-parameter model in at most the
time of 8 runs one by one, i.e. a speed-up of at least 8 at M = 64.

Both sides run the step of a training run, without the data pipeline (the same synthetic token
batches for both, drawn once): forward under the run's autocast, backward of the mean token
loss, clipping at 1.0, AdamW at the scheduled rate.
- one by one: the ordinary trainer's model and optimizer (`trainer.build.build_model`,
  `trainer.optim.build.build_optimizer`, the run's resolved `RunFacts`: on CUDA bf16 parameters
  with fp32 master weights, on the CPU fp32), `--single` models in turn, each for the warm-up
  and timed steps; a run's step time is their median, and M runs cost M times that;
- stacked: `trainer.stacked.run.StackedRun` over M models (fp32 parameters, bf16 autocast on
  CUDA) in chunks of `--chunk-size`, the step time the median over the timed steps.
Speed-up = M x (one run's step) / (the stacked step of all M); `runs in its time` = the
stacked step over one run's step (at most 8 meets the target). `--compile` sets
`model.compile` for both (whole-model graphs on CUDA). `--unfused-head`: the stacked head
unfused (its logits kept for backward, as before issue 37) instead of `trainer.stacked.head`'s
(design section 4d-iii), to compare.

Usage (repository root; defaults: the ~5M shape, 64 models):
    python experiments/tools/bench/stacked_bench.py [--models 64] [--steps 5] [--device cuda]
On the CPU the numbers are a smoke test, not a result. `--profile N` then profiles one more
stacked step (`torch.profiler`) and prints its N costliest kernels: where the step goes, the
first thing to read before changing it (issue 37 item 4; design section 4d-iii). `--count-ops`
prints how many aten ops one stacked step dispatches (`op_counts`), which must not grow with
`--models`: a per-model op is a per-model kernel launch on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from timing import profile_table  # noqa: E402

from data.config import DataConfig  # noqa: E402
from data.store.batch import IGNORE_INDEX  # noqa: E402
from trainer.build import RunFacts, build_model  # noqa: E402
from trainer.config.schema import ModelConfig, TrainConfig, TrainerConfig  # noqa: E402
from trainer.optim.build import build_optimizer  # noqa: E402
from trainer.parallel.context import ParallelContext  # noqa: E402
from trainer.run.schedule_extension import scheduled_lr  # noqa: E402
from trainer.stacked.run import StackedRun  # noqa: E402


class SyntheticFeed:
    """`trainer.stacked.feed.StackedFeed`'s interface over fixed random batches [M, b, s]."""

    def __init__(self, batches: dict[str, torch.Tensor]):
        self.batches = batches

    @property
    def models(self) -> int:
        return self.batches["input_ids"].shape[0]

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        return [self.batches]


def bench_config(args: argparse.Namespace) -> TrainerConfig:
    model = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
        attention="sdpa",
        compile=args.compile,
    )
    train = TrainConfig(
        steps=1000, global_batch_size=args.batch, lr=1e-3, warmup_steps=10, grad_clip=1.0, device=args.device
    )
    return TrainerConfig(model=model, data=DataConfig(seq_len=args.seq), train=train)


def synthetic_batches(models: int, args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (models, args.batch, args.seq + 1), generator=g)
    return {"input_ids": ids[..., :-1].to(device), "labels": ids[..., 1:].contiguous().to(device)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def ordinary_step(cfg: TrainerConfig, pc: ParallelContext, facts: RunFacts, batch: dict[str, torch.Tensor]):
    """One ordinary run's step (a fresh model and optimizer of the run's resolved facts)."""
    model = build_model(cfg, pc, facts)
    optimizer = build_optimizer(
        list(model.named_parameters()), cfg.train, pc, zero1=False, param_dtype=facts.param_dtype
    )
    autocast = facts.autocast()
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        with autocast:
            losses = model(None, batch)
        mask = batch["labels"] != IGNORE_INDEX
        (losses * mask / mask.sum().clamp_min(1)).sum().backward()
        optimizer.clip_grad_norm(cfg.train.grad_clip)
        optimizer.step(scheduled_lr(state["step"], cfg.train, None))
        optimizer.zero_grad()

    return step


def one_by_one(cfg: TrainerConfig, batches: dict[str, torch.Tensor], args: argparse.Namespace) -> list[float]:
    """Step times of `--single` ordinary runs, one after another (each its own model)."""
    pc = ParallelContext.single(batches["input_ids"].device)
    facts = RunFacts.resolve(cfg, pc)
    times: list[float] = []
    for m in range(args.single):
        batch = {k: v[m % v.shape[0]] for k, v in batches.items()}
        times += timed(ordinary_step(cfg, pc, facts, batch), pc.device, args.warmup, args.steps)
    return times


def stacked(cfg: TrainerConfig, batches: dict[str, torch.Tensor], args: argparse.Namespace) -> list[float]:
    """Step times of all M models stacked (chunk by chunk within each step's time)."""
    device = batches["input_ids"].device
    # fp32 parameters under the run's autocast, as `trainer.stacked.train.train_stacked`.
    facts = dataclasses.replace(RunFacts.resolve(cfg, ParallelContext.single(device)), param_dtype=torch.float32)
    size = args.chunk_size or args.models
    runs = []
    for start in range(0, args.models, size):
        part = {k: v[start : start + size] for k, v in batches.items()}
        seeds = list(range(start, start + len(part["labels"])))
        runs.append(StackedRun(cfg, SyntheticFeed(part), seeds, device, facts.autocast()))
        runs[-1].model.fused_head = not args.unfused_head

    def step() -> None:
        for run in runs:
            run.train_step()

    times = timed(step, device, args.warmup, args.steps)
    if args.profile:
        print(profile_table(step, device, args.profile), flush=True)
    if args.count_ops:
        ops = op_counts(step)
        print(f"one stacked step dispatches {sum(ops.values())} aten ops: {dict(ops.most_common(8))} ...", flush=True)
    return times


def op_counts(step) -> collections.Counter:
    """How many times one `step` (already warm) dispatches each aten op from Python or autograd:
    the ops not nested in another aten op (a composite's own calls are its business, and vary
    with sizes on the CPU), each the launch of at most a fixed number of kernels on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            counts[event.name] += 1
    return counts


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=64)
    p.add_argument("--single", type=int, default=8, help="ordinary runs timed one by one")
    p.add_argument("--chunk-size", type=int, default=0, help="models stacked at once (0: all)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--unfused-head",
        action="store_true",
        help="the unfused stacked head (its logits kept for backward), to compare",
    )
    p.add_argument("--profile", type=int, default=0, help="print the stacked step's N costliest kernels (0: none)")
    p.add_argument("--count-ops", action="store_true", help="print the aten ops one stacked step dispatches")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cfg = bench_config(args)
    args.single = min(args.single, args.models)
    batches = synthetic_batches(args.models, args, device)
    single = statistics.median(one_by_one(cfg, batches, args))
    print(f"one run's step: {single * 1e3:.2f} ms (median of {args.single} runs x {args.steps} steps)", flush=True)
    together = statistics.median(stacked(cfg, batches, args))
    params = sum(p.numel() for p in build_model(cfg, ParallelContext.single("cpu")).parameters())
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "models": args.models,
        "params_per_model": params,
        "single_step_s": single,
        "stacked_step_s": together,
        "speedup": args.models * single / together,
        "runs_in_stacked_time": together / single,
    }
    note = "" if device.type == "cuda" else " (CPU: not a result)"
    print(
        f"{result['device']}{note}: {args.models} models of {params / 1e6:.2f}M parameters, "
        f"d_model {args.d_model}, {args.layers} layers, batch {args.batch} x {args.seq}\n"
        f"  one run's step       {single * 1e3:9.2f} ms  (median of {args.single} runs x {args.steps} steps)\n"
        f"  all {args.models} stacked      {together * 1e3:9.2f} ms  (chunks of {args.chunk_size or args.models}, "
        f"{'unfused' if args.unfused_head else 'fused'} head)\n"
        f"  speed-up             {result['speedup']:9.2f} x  (= the stacked step costs "
        f"{result['runs_in_stacked_time']:.2f} runs one by one; target <= 8 at M = 64)"
    )
    return result


if __name__ == "__main__":
    main()
