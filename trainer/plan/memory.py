"""Predicted memory per rank and pipeline stage before a run (`doremi plan`), and whether it fits.

Every tp x dp rank of one stage holds the same amounts (ZeRO-1 shards differ by rounding only),
so a stage's row is also its per-rank number. The formulas are `trainer.plan.stage_split`'s:
parameters by `BytesPerParam`, activations per block by `CostModel.layer_activation_bytes`,
micro-batches in flight by the schedule. Not counted, and covered by `headroom`: the CUDA
context, NCCL buffers, allocator fragmentation and the backward pass's gradient workspace.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, TrainerConfig
from trainer.config.tools import ConfigError
from trainer.plan.cost_model import CostModel, StageMemory
from trainer.plan.moe import MoEMemory, moe_stage_memory
from trainer.plan.resolve import micro_batch_size, param_precision
from trainer.plan.stage_split import split_layers, split_policy

GIB = 2**30


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: range
    memory: StageMemory
    flops_per_micro_batch: float
    #: the proxy's frozen online reference model on this stage (bf16 or fp32 weights, no grads)
    frozen: float = 0.0
    #: what the stage's MoE blocks add (experts, their state, all-to-all buffers); None: dense
    moe: MoEMemory | None = None

    @property
    def total(self) -> float:
        return self.memory.total + self.frozen + (self.moe.total if self.moe else 0.0)


@dataclass(frozen=True)
class Plan:
    model: str
    gpus: int
    gpu_memory_gb: float
    headroom: float
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    seq_len: int
    micro_batches: int
    schedule: str
    recompute: str
    sequence_parallel: bool
    recompute_allgather: bool
    param_precision: str
    optimizer: str
    split: str  # "explicit", "memory" or "compute"
    layer_activation_bytes: float
    stages: list[StagePlan]

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GIB * (1.0 - self.headroom)

    @property
    def peak_bytes(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.total).stage

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes


def gpu_param_precision(cfg: TrainerConfig) -> str:
    """`plan_memory`'s param_precision for `cfg` run on GPUs: train.param_dtype as the trainer
    resolves it on CUDA (`trainer.plan.resolve.param_dtype`), so `doremi plan` plans what will run."""
    return param_precision(cfg, torch.device("cuda"))


def model_name(model: ModelConfig) -> str:
    """The preset's name only when every dimension equals the preset's; otherwise what differs."""
    preset = PRESETS.get(model.preset or "", {})
    dims = {k: v for k, v in preset.items() if isinstance(v, int) and hasattr(model, k)}
    diffs = [f"{k}={getattr(model, k)}" for k, v in dims.items() if getattr(model, k) != v]
    if preset and not diffs:
        return str(model.preset)
    if preset:
        return f"custom ({model.preset} with {', '.join(diffs)})"
    return f"custom (d_model={model.d_model}, n_layers={model.n_layers}, ffn_dim={model.ffn_dim}, vocab_size={model.vocab_size})"


def with_gpus(cfg: TrainerConfig, gpus: int) -> TrainerConfig:
    """`cfg` on `gpus` GPUs: dp = gpus / (tp x pp), the global batch kept (so the micro-batch
    size follows). One clear error when tp x pp does not divide `gpus`."""
    par = cfg.parallelism
    if gpus < 1 or gpus % (par.tp * par.pp):
        raise ConfigError(
            f"--gpus: expected a positive multiple of parallelism.tp x parallelism.pp = {par.tp} x {par.pp} "
            f"= {par.tp * par.pp}, got {gpus}"
        )
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(par, dp=gpus // (par.tp * par.pp)))


def plan_memory(
    cfg: TrainerConfig,
    gpus: int,
    gpu_memory_gb: float,
    *,
    split: str | None = None,
    param_precision: str | None = None,
    headroom: float = 0.10,
    memory_weight: float = 0.5,
    frozen_reference: bool = False,
) -> Plan:
    """Memory of every pipeline stage for `cfg` on `gpus` GPUs of `gpu_memory_gb` GiB each.

    The layer split is the trainer's (`trainer.plan.stage_split.split_layers`):
    `parallelism.pp_layers` when set and `split` is None, else the cost model's under `split`
    ("memory" by default, or "compute"). Micro-batch size = global_batch_size / (dp x
    micro_batches); sequence length = data.seq_len. `param_precision`: "fp32" (fp32 params
    under bf16 autocast) or "bf16" (bf16 params, fp32 main grads and master weights, the GPU
    path by default: `gpu_param_precision`); see `trainer.plan.cost_model.BytesPerParam`.
    None: what the run resolves on the GPUs (`gpu_param_precision`), not on this machine.
    dp = gpus / (tp x pp) (`with_gpus`). `frozen_reference`: the stage also holds a frozen copy of
    the same model (the DoReMi proxy's online reference), weights only."""
    cfg = with_gpus(cfg, gpus)
    par, train = cfg.parallelism, cfg.train
    param_precision = param_precision or gpu_param_precision(cfg)
    _check_plan_inputs(cfg, gpu_memory_gb, headroom)
    mbs = micro_batch_size(cfg)
    cm = CostModel.from_config(
        cfg.model, par, mbs, cfg.data.seq_len, train.micro_batches, param_precision, train.optimizer
    )
    frozen_bytes = {"fp32": 4.0, "bf16": 2.0}[param_precision] if frozen_reference else 0.0
    layers = split_layers(
        cfg.model,
        par,
        mbs,
        cfg.data.seq_len,
        micro_batches=train.micro_batches,
        policy=split,
        memory_weight=memory_weight,
        param_precision=param_precision,
    )
    how = split_policy(par.pp_layers, split)
    stages = _stage_plans(cfg, cm, layers, mbs, param_precision, frozen_bytes)
    return _assemble_plan(cfg, gpus, gpu_memory_gb, headroom, cm, param_precision, how, stages)


def _check_plan_inputs(cfg: TrainerConfig, gpu_memory_gb: float, headroom: float) -> None:
    """The plan's own arguments and the batch divisibility, refused before any cost is computed."""
    par, train = cfg.parallelism, cfg.train
    if not (math.isfinite(gpu_memory_gb) and gpu_memory_gb > 0):  # nan: every comparison false, "usable nan GiB"
        raise ConfigError(f"--gpu-memory: expected a positive number of GiB, got {gpu_memory_gb}")
    if not 0.0 <= headroom < 1.0:
        raise ConfigError(f"headroom: expected a fraction in [0, 1), got {headroom}")
    per_rank = par.dp * train.micro_batches
    if train.global_batch_size % per_rank:
        raise ConfigError(
            f"train.global_batch_size: expected a multiple of parallelism.dp x train.micro_batches "
            f"= {per_rank}, got {train.global_batch_size}"
        )


def _stage_plans(
    cfg: TrainerConfig,
    cm: CostModel,
    layers: list[range],
    mbs: int,
    param_precision: str,
    frozen_bytes: float,
) -> list[StagePlan]:
    """One `StagePlan` per pipeline stage: the cost model's memory and FLOPs for its layers, the
    frozen reference's weights and the MoE extras."""
    par, train = cfg.parallelism, cfg.train
    return [
        StagePlan(
            p,
            r,
            cm.stage_memory(p, len(r), r.start),
            cm.stage_flops(p, len(r), r.start),
            frozen_bytes * cm.stage_params(p, len(r), r.start),
            moe_stage_memory(cfg.model, par, r, mbs, cfg.data.seq_len, param_precision, train.optimizer),
        )
        for p, r in enumerate(layers)
    ]


def _assemble_plan(
    cfg: TrainerConfig,
    gpus: int,
    gpu_memory_gb: float,
    headroom: float,
    cm: CostModel,
    param_precision: str,
    how: str,
    stages: list[StagePlan],
) -> Plan:
    par, train = cfg.parallelism, cfg.train
    return Plan(
        model=model_name(cfg.model),
        gpus=gpus,
        gpu_memory_gb=gpu_memory_gb,
        headroom=headroom,
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        micro_batch_size=cm.micro_batch_size,
        seq_len=cm.seq_len,
        micro_batches=train.micro_batches,
        schedule=par.pp_schedule,
        recompute=par.recompute,
        sequence_parallel=cm.sequence_parallel,
        recompute_allgather=par.tp_recompute_allgather,
        param_precision=param_precision,
        optimizer=train.optimizer,
        split=how,
        layer_activation_bytes=cm.layer_activation_bytes(),
        stages=stages,
    )


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def memory_unit(largest: float) -> tuple[str, float]:
    """(name, bytes) of the unit a table of sizes up to `largest` bytes reads in: GiB from 1
    GiB, MiB from 1 MiB, else KiB (a small model's plan is not a table of 0.0)."""
    for name, size in (("GiB", GIB), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def human_bytes(x: float) -> str:
    name, size = memory_unit(x)
    return f"{x / size:.1f} {name}"


def human_count(n: float) -> str:
    """1234 -> 1.23K, 5.2e8 -> 520M, 7.05e10 -> 70.5B: parameters at any scale."""
    for suffix, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.0f}"


def human_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


#: What each (parameter precision, optimizer) holds per parameter, as the plan's header names it.
_PARAM_LAYOUTS = {
    ("fp32", "adamw"): "fp32 params + bf16 autocast copy, fp32 grads, AdamW (fp32 m, v)",
    (
        "fp32",
        "adafactor",
    ): "fp32 params + bf16 autocast copy, fp32 grads, Adafactor (factored fp32 second moment, no first moment)",
    ("bf16", "adamw"): "bf16 params, fp32 main grads, fp32 master (as a 16-bit remainder) + AdamW (fp32 m, v)",
}

_PLAN_COLUMNS = [
    "stage",
    "layers",
    "params",
    "weights",
    "grads",
    "optim",
    "cast",
    "act/mb",
    "in-flight",
    "activations",
    "transient",
    "frozen ref",
    "total",
]


def format_plan(plan: Plan, title: str = "") -> str:
    """A table, one row per pipeline stage (= per rank of that stage), sizes in one unit
    chosen for the largest (`memory_unit`), named above the table."""
    p = plan
    unit, size = memory_unit(max(s.total for s in p.stages))
    head = _plan_header(p, title, unit)
    cols = list(_PLAN_COLUMNS)
    rows = [_stage_row(s, size) for s in p.stages]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    tail = _plan_footer(p, unit, size)
    return "\n".join(head + [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows] + tail)


def _plan_header(p: Plan, title: str, unit: str) -> list[str]:
    """The lines above the table: the layout, the batch and schedule, the precision, the split."""
    params = _PARAM_LAYOUTS[(p.param_precision, p.optimizer)]
    return [
        *([title] if title else []),
        f"model {p.model}: tp{p.tp} x pp{p.pp} x dp{p.dp} = {p.gpus} GPUs of {p.gpu_memory_gb:g} GiB",
        f"micro-batch {p.micro_batch_size} x {p.seq_len} tokens, {p.micro_batches} micro-batches per dp rank, "
        f"schedule {p.schedule}, recompute {p.recompute}, sequence parallel {'on' if p.sequence_parallel else 'off'}, "
        f"recomputed all-gather {'on' if p.recompute_allgather else 'off'}",
        f"{params}; optimizer state sharded over dp={p.dp} (ZeRO-1)",
        f"layer split: {p.split}; activations per block per micro-batch {human_bytes(p.layer_activation_bytes)}",
        "",
        f"memory per rank of each stage, in {unit}:",
    ]


def _in_unit(x: float, size: float) -> str:
    return f"{x / size:.1f}"


def _stage_row(s: StagePlan, size: float) -> list[str]:
    """One stage's cells, in `_PLAN_COLUMNS` order, sizes in units of `size` bytes."""
    m = s.memory
    layers = f"{s.layers.start}-{s.layers.stop - 1} ({len(s.layers)})"
    return [
        str(s.stage),
        layers,
        human_count(m.params + (s.moe.params_delta if s.moe else 0)),
        _in_unit(m.weights, size),
        _in_unit(m.grads, size),
        _in_unit(m.optimizer, size),
        _in_unit(m.cast, size),
        _in_unit(m.activations_per_micro_batch, size),
        str(m.in_flight),
        _in_unit(m.activations, size),
        _in_unit(m.transient, size),
        _in_unit(s.frozen, size),
        _in_unit(s.total, size),
    ]


def _plan_footer(p: Plan, unit: str, size: float) -> list[str]:
    """The lines below the table: each MoE stage's extras, then the peak and the verdict."""
    verdict = "fits" if p.fits else "does NOT fit"
    moe = [
        f"stage {s.stage} MoE ({s.moe.blocks} blocks, in params and the total): {human_count(s.moe.expert_params)} expert "
        f"params on this rank, weights {_in_unit(s.moe.weights, size)} / grads {_in_unit(s.moe.grads, size)} / optim "
        f"{_in_unit(s.moe.optimizer, size)} {unit} beyond the dense columns, all-to-all buffers {human_bytes(s.moe.all_to_all)}"
        for s in p.stages
        if s.moe is not None
    ]
    return [
        "",
        *moe,
        f"peak {human_bytes(p.peak_bytes)} on stage {p.peak_stage}; usable {_gib(p.usable_bytes)} GiB "
        f"({p.gpu_memory_gb:g} GiB less {p.headroom:.0%} headroom): {verdict}",
    ]
