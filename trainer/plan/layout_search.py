"""Which layouts of N GPUs fit, fastest first (`doremi plan`'s search).

A layout is tp x pp x dp = N, the micro-batches per dp rank and the recompute mode; the global
batch, the model and everything else stay as configured. Candidates obey the rules
`TrainerConfig.validate` enforces (tp divides n_kv_heads and ffn_dim, pp <= n_layers, at least pp
micro-batches when pp > 1, dp x micro-batches divides the global batch, seq_len a multiple of tp
with sequence parallel); each is planned by `trainer.plan.memory.plan_memory` for every stage that runs
it (the same split the trainer builds), and ranked by `step_seconds`.

The step-time model (`Hardware` holds its numbers) is deliberately simple and relative - it
orders layouts, it does not predict wall-clock:
- compute: the slowest stage's FLOPs per micro-batch (`CostModel.stage_flops`, recompute
  included) at `peak_flops x efficiency`, times M + pp - 1 slots (the pipeline bubble of 1F1B
  and of all-forward-all-backward alike);
- tensor parallel: per block and micro-batch, 4 ring all-reduces of the T x h bf16 activation
  (2 forward, 2 backward; sequence parallel's all-gather + reduce-scatter move the same bytes),
  2 more with full recompute, 1 more with the recomputed all-gather; each moves 2 (t - 1) / t of
  the tensor and nothing overlaps compute (tp_async's overlap is ignored);
- pipeline: each micro-batch's activation and its gradient cross every stage boundary once;
- data parallel: once per step, a reduce-scatter + all-gather (= one all-reduce) of the fp32
  gradients of the largest stage, not overlapped with the backward;
- links: ranks are numbered tp fastest, then dp, then pp; a group whose ranks span at most
  `gpus_per_node` consecutive ranks talks over NVLink (`intra_node_bw`), otherwise over the
  network (`inter_node_bw`). Bandwidths are per GPU, bytes/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config.schema import TrainerConfig
from trainer.config.tools import ConfigError
from trainer.plan.cost_model import ACT_BYTES, CostModel
from trainer.plan.memory import Plan, plan_memory

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Hardware:
    """H100/H200-class defaults: bf16 dense peak, a typical achieved fraction, NVLink and 400 Gb/s
    InfiniBand per GPU."""

    peak_flops: float = 989e12
    efficiency: float = 0.5
    intra_node_bw: float = 360e9
    inter_node_bw: float = 45e9
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batches: int
    recompute: str

    def overrides(self, prefix: str = "") -> list[str]:
        """The `--set` overrides that write this layout into a config (`prefix`: where the
        section lives, e.g. "pipeline.main." for the main runs)."""
        return [
            f"{prefix}parallelism.tp={self.tp}",
            f"{prefix}parallelism.pp={self.pp}",
            f"{prefix}parallelism.dp={self.dp}",
            f"{prefix}parallelism.pp_layers=[]",
            f"{prefix}parallelism.recompute={self.recompute}",
            f"{prefix}train.micro_batches={self.micro_batches}",
        ]

    def describe(self) -> str:
        return (
            f"tp{self.tp} x pp{self.pp} x dp{self.dp}, {self.micro_batches} micro-batches, recompute {self.recompute}"
        )


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    plans: list[tuple[str, Plan]]
    seconds: float

    @property
    def fits(self) -> bool:
        return all(p.fits for _, p in self.plans)

    @property
    def peak_bytes(self) -> float:
        return max(p.peak_bytes for _, p in self.plans)


def with_layout(cfg: TrainerConfig, layout: Layout) -> TrainerConfig:
    """`cfg` with `layout` in place (explicit pp_layers dropped: the cost model splits), validated."""
    par = dataclasses.replace(
        cfg.parallelism,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        pp_layers=[] if layout.pp != cfg.parallelism.pp else cfg.parallelism.pp_layers,
        recompute=layout.recompute,
    )
    out = dataclasses.replace(
        cfg, parallelism=par, train=dataclasses.replace(cfg.train, micro_batches=layout.micro_batches)
    )
    out.validate()
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: TrainerConfig, gpus: int) -> list[Layout]:
    """Every layout of `gpus` GPUs the config validation accepts for `cfg`."""
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if cfg.train.global_batch_size % dp:
                continue
            for m in _divisors(cfg.train.global_batch_size // dp):
                for recompute in RECOMPUTE:
                    layout = Layout(tp, pp, dp, m, recompute)
                    try:
                        with_layout(cfg, layout)
                    except ConfigError:
                        continue
                    out.append(layout)
    return out


def _link_bw(size: int, stride: int, hw: Hardware) -> float:
    return hw.intra_node_bw if size * stride <= hw.gpus_per_node else hw.inter_node_bw


def _ring(size: int, nbytes: float, bw: float) -> float:
    """Seconds of one ring all-reduce of `nbytes` per GPU over `size` ranks."""
    return 0.0 if size == 1 else 2 * (size - 1) / size * nbytes / bw


def step_seconds(plan: Plan, cfg: TrainerConfig, hw: Hardware = Hardware()) -> float:
    """Predicted seconds of one training step of `plan` (see the module docstring)."""
    tp, pp, dp = plan.tp, plan.pp, plan.dp
    cm = CostModel.from_config(
        cfg.model, cfg.parallelism, plan.micro_batch_size, plan.seq_len, plan.micro_batches, plan.param_precision
    )
    activation = ACT_BYTES * cm.tokens * cfg.model.d_model
    collectives = 4 + {"none": 0, "selective": 0, "full": 2}[plan.recompute] + (1 if plan.recompute_allgather else 0)
    tp_block = collectives * _ring(tp, activation, _link_bw(tp, 1, hw))
    p2p = 2 * activation / (tp if plan.sequence_parallel else 1) / _link_bw(2, tp * dp, hw) if pp > 1 else 0.0
    slot = max(
        s.flops_per_micro_batch / (hw.peak_flops * hw.efficiency) + len(s.layers) * tp_block for s in plan.stages
    )
    grads = max(s.memory.params for s in plan.stages) * 4.0
    return (slot + p2p) * (plan.micro_batches + pp - 1) + _ring(dp, grads, _link_bw(dp, tp, hw))


def search(
    stages: list[tuple[str, TrainerConfig, bool]],
    gpus: int,
    gpu_memory_gb: float,
    hw: Hardware = Hardware(),
    headroom: float = 0.10,
) -> list[Candidate]:
    """Every layout of `gpus` GPUs for the stages that share one layout (name, config, whether
    it holds a frozen reference), planned for each stage: those that fit first, fastest first
    (summed over the stages), then the rest by peak memory."""
    if not stages:
        return []
    found = []
    for layout in layouts(stages[0][1], gpus):
        plans, seconds = [], 0.0
        for name, cfg, frozen in stages:
            try:
                staged = with_layout(cfg, layout)
            except ConfigError:
                break
            plan = plan_memory(staged, gpus, gpu_memory_gb, headroom=headroom, frozen_reference=frozen)
            plans.append((name, plan))
            seconds += step_seconds(plan, staged, hw)
        else:
            found.append(Candidate(layout, plans, seconds))
    return sorted(found, key=lambda c: (not c.fits, c.seconds if c.fits else c.peak_bytes, c.peak_bytes))
