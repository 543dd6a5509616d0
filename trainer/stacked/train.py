"""`train_stacked`: M runs of one config, each on its own mixture, trained stacked in chunks.

An offline mixing method (RegMix, Liu et al. ICLR 2025; Data Mixing Laws, Ye et al. ICLR 2025)
trains many small models on designed mixtures and fits mixture -> validation loss. Each of
these runs is the ordinary trainer's run of `cfg` with `data.domain_weights = mixtures[m]` and
`train.seed = seeds[m]` (to fp32 rounding; `trainer.stacked` says why), but all M share each
step's kernels. `chunk_size` bounds how many are stacked at once (memory); the chunks run one
after another, and each model's numbers do not depend on the chunking (no op mixes models).

Precision follows the config as `trainer.build.RunFacts` resolves it (fp32 on the CPU, bf16
autocast on CUDA), with fp32 parameters: the ordinary run with `train.param_dtype: fp32`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data.progress import Countdown
from data.sampling.weights import resolve_weights
from trainer.build import RunFacts, check_device, seed_everything
from trainer.config.schema import TrainerConfig
from trainer.config.tools import ConfigError
from trainer.feed.data_feed import DataFeed
from trainer.parallel.context import ParallelContext
from trainer.run.determinism import set_deterministic
from trainer.stacked.feed import StackedFeed
from trainer.stacked.run import ChunkResult, StackedRun


@dataclass
class StackedResult:
    """Per model m (rows), in the order of `mixtures`."""

    domains: list[str]
    mixtures: np.ndarray  # [M, k] the resolved (normalised) sampling weights
    seeds: list[int]  # train.seed of each model
    losses: np.ndarray  # [M, steps] mean training token loss per step (metrics.jsonl's `loss`)
    grad_norms: np.ndarray  # [M, steps] global gradient norm before clipping (`grad_norm`)
    evals: list[tuple[int, np.ndarray]]  # (step, [M, k] per-domain validation loss)
    params: list[dict[str, torch.Tensor]] | None  # final `Llama` state dict per model (CPU)
    seconds: float  # wall time of the training and evaluation

    @property
    def final_eval(self) -> np.ndarray:
        """[M, k]: the validation losses after the last step."""
        return self.evals[-1][1]


def check_stackable(cfg: TrainerConfig) -> None:
    """One-line ConfigErrors for what a stacked run does not do."""
    p = cfg.parallelism
    if (p.tp, p.pp, p.dp) != (1, 1, 1):
        raise ConfigError(
            f"parallelism: stacked training runs every model whole in one process, expected tp = pp = dp = 1, "
            f"got tp={p.tp} pp={p.pp} dp={p.dp}"
        )
    if cfg.train.param_dtype == "bf16":
        raise ConfigError("train.param_dtype: stacked training keeps fp32 parameters, got 'bf16' (use fp32 or auto)")
    if cfg.model.init_from_hf:
        raise ConfigError("model.init_from_hf: stacked training initialises every model from its seed, got a path")
    for key in ("fp8", "mup", "moe"):
        if getattr(cfg.model, key, None) is not None:
            raise ConfigError(
                f"model.{key}: stacked training runs the plain Llama (no FP8, muP or MoE), expected none "
                f"(or set sweep.stacked: false)"
            )
    if "M" in cfg.model.block_pattern:
        raise ConfigError(
            f"model.block_pattern: stacked training runs attention blocks only, got {cfg.model.block_pattern!r} "
            f"(or set sweep.stacked: false)"
        )


def check_mixtures(mixtures: np.ndarray, domains: Sequence[str]) -> np.ndarray:
    """`mixtures` as a float64 [M, k] array, or a one-line ConfigError."""
    arr = np.asarray(mixtures)
    k = len(domains)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != k or arr.dtype.kind not in "iuf":
        raise ConfigError(
            f"mixtures: expected numbers of shape [M, {k}] (M >= 1 runs; domains {', '.join(domains)}), "
            f"got shape {tuple(arr.shape)} of {arr.dtype}"
        )
    return arr.astype(np.float64)


def chunks(models: int, chunk_size: int | None) -> list[range]:
    """Consecutive ranges of at most `chunk_size` models (all at once when None)."""
    size = models if chunk_size is None else chunk_size
    if size < 1:
        raise ConfigError(f"chunk_size: expected >= 1 or None, got {chunk_size}")
    return [range(start, min(start + size, models)) for start in range(0, models, size)]


def run_device(cfg: TrainerConfig) -> torch.device:
    """train.device resolved as `trainer.parallel.context.ParallelContext.initialize` does."""
    check_device(cfg)
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def train_stacked(
    cfg: TrainerConfig,
    mixtures: np.ndarray,
    eval_every: int = 0,
    seeds: Sequence[int] | None = None,
    chunk_size: int | None = None,
    keep_params: bool = True,
    label: str | None = None,
) -> StackedResult:
    """Train M = len(mixtures) models of `cfg` for `train.steps` steps, model m on `mixtures[m]`
    (in `data.domains` order, normalised) from `train.seed = seeds[m]` (default: `cfg.train.seed`
    for all). Validation losses (`train.eval_sequences` per domain) at every `eval_every`-th step
    and at the last step (0: the last step only). `keep_params`: return each model's final
    parameters. `label`: report each chunk's steps on stderr under it (`data.progress`). Writes
    nothing but those lines."""
    check_stackable(cfg)
    set_deterministic(cfg.train.deterministic)
    device = run_device(cfg)
    pc = ParallelContext.single(device)
    facts = dataclasses.replace(RunFacts.resolve(cfg, pc), param_dtype=torch.float32)
    seed_everything(cfg.train.seed)
    t = cfg.train
    feed = DataFeed(cfg.data, t.global_batch_size, t.micro_batches, pc, seed=cfg.data.seed)
    feed.check_vocab(cfg.model.vocab_size)
    arr = check_mixtures(mixtures, feed.domains)
    weights = np.stack(
        [resolve_weights(row.tolist(), feed.manifest, where=f"mixtures[{m}]") for m, row in enumerate(arr)]
    )
    seeds = [t.seed] * len(arr) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(arr):
        raise ConfigError(f"seeds: expected one per mixture ({len(arr)}), got {len(seeds)}")
    if eval_every < 0:
        raise ConfigError(f"eval_every: expected >= 0, got {eval_every}")
    validation = feed.validation(facts.micro_batch_size, t.eval_sequences, "sweep_run")
    start = time.perf_counter()
    parts: list[ChunkResult] = []
    for part in chunks(len(arr), chunk_size):
        stacked_feed = StackedFeed(feed, weights[part.start : part.stop], t.micro_batches)
        run = StackedRun(cfg, stacked_feed, seeds[part.start : part.stop], device, facts.autocast())
        countdown = Countdown(f"{label}: step", t.steps) if label else None
        parts.append(run.fit(t.steps, eval_every, validation, keep_params, countdown))
        del run
    steps = [s for s, _ in parts[0].evals]
    return StackedResult(
        domains=list(feed.domains),
        mixtures=weights,
        seeds=seeds,
        losses=np.concatenate([p.losses for p in parts]),
        grad_norms=np.concatenate([p.grad_norms for p in parts]),
        evals=[(s, np.concatenate([p.evals[i][1] for p in parts])) for i, s in enumerate(steps)],
        params=[sd for p in parts for sd in p.params] if keep_params else None,
        seconds=time.perf_counter() - start,
    )
