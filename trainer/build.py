"""Turning a config into the objects a run holds: the process grid, the run's resolved facts
(`RunFacts`), the model stage. Shared by training, the frozen DoReMi reference, scoring and eval.

The rules (`use_bf16`, `param_dtype`, `micro_batch_size`: `trainer.plan.resolve`; `autocast`,
`stage_layers`) are functions of the config and the device. A run resolves them once per config, into `RunFacts`,
and hands that on: the loop, the reference and the stage commands read the facts instead of
asking the config again."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from trainer.config.launch_env import launch_world_size, local_world_size
from trainer.config.schema import TrainerConfig, require_vocab_size
from trainer.config.tools import ConfigError
from trainer.parallel.context import ParallelContext
from trainer.plan.resolve import micro_batch_size, param_dtype, param_precision, precision_name, use_bf16
from trainer.plan.stage_split import split_layers


def check_world_size(cfg: TrainerConfig) -> None:
    p = cfg.parallelism
    world = launch_world_size()
    if world != p.world_size:
        raise ConfigError(
            f"parallelism: world size {world} (torchrun) != tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = {p.world_size}"
        )


def check_device(cfg: TrainerConfig) -> None:
    """A CUDA device asked for (train.device, or parallelism.backend nccl) that this process
    cannot have is a ConfigError before any work, not torch's traceback from set_device.
    Every local rank checks every local rank's device, so rank 0 reports a missing one."""
    device, backend = cfg.train.device, cfg.parallelism.backend
    if device != "cuda" and backend != "nccl":
        return
    if device == "cpu":
        raise ConfigError(
            "parallelism.backend: 'nccl' runs on CUDA devices, got train.device='cpu' (use backend gloo or auto)"
        )
    key = "train.device" if device == "cuda" else "parallelism.backend"
    asked = f"{key}={device!r}" if device == "cuda" else f"{key}='nccl'"
    if not torch.backends.cuda.is_built():
        fix = "train.device cpu or auto" if device == "cuda" else "parallelism.backend gloo or auto"
        raise ConfigError(f"{asked}: this PyTorch build has no CUDA (torch {torch.__version__}); use {fix}")
    local = local_world_size()
    visible = torch.cuda.device_count()
    if visible < local:
        raise ConfigError(
            f"{asked}: {local} process(es) on this node need {local} CUDA device(s), "
            f"{visible} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def init_parallel(cfg: TrainerConfig) -> ParallelContext:
    check_world_size(cfg)
    check_device(cfg)
    p = cfg.parallelism
    return ParallelContext.initialize(p.tp, p.pp, p.dp, backend=p.backend, device=cfg.train.device, ep=p.ep)


def seed_everything(seed: int) -> None:
    # Tiny gradients and Adam moments underflow to denormals, which run ~100x slower on x86
    # CPUs (measured: a 1M-parameter step 3.4x slower); flushing them to zero costs no accuracy
    # that fp32 training can use.
    torch.set_flush_denormal(True)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# -- the rules -------------------------------------------------------------------------------


def autocast(cfg: TrainerConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a run of `cfg` computes under on `device` (see `_autocast`)."""
    return _autocast(device, use_bf16(cfg, device), param_dtype(cfg, device))


def _autocast(device: torch.device, bf16: bool, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast for fp32 parameters computing in bf16. bf16 parameters run without it: they
    already compute in bf16, and autocast would only add casts to fp32 (RMSNorm is on its fp32
    list), which compiled blocks then keep for backward as fp32 copies of the hidden state."""
    if bf16 and dtype == torch.float32:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stage_layers(cfg: TrainerConfig, device: torch.device) -> list[range]:
    """Layers per pipeline stage (`trainer.plan.stage_split.split_layers`) for the parameter
    precision the run resolves to on `device`: the split `doremi plan` (`trainer.plan.memory`) predicts."""
    return split_layers(
        cfg.model,
        cfg.parallelism,
        micro_batch_size(cfg),
        cfg.data.seq_len,
        micro_batches=cfg.train.micro_batches,
        param_precision=param_precision(cfg, device),
    )


# -- resolved once per run -------------------------------------------------------------------


@dataclass(frozen=True)
class RunFacts:
    """What a run of one config on one rank's device resolves to, computed once
    (`RunFacts.resolve`) and passed on."""

    device: torch.device
    bf16: bool  # computes in bf16
    param_dtype: torch.dtype
    micro_batch_size: int
    stage_layers: tuple[range, ...]  # per pipeline stage
    is_main: bool  # global rank 0

    @classmethod
    def resolve(cls, cfg: TrainerConfig, pc: ParallelContext) -> RunFacts:
        device = pc.device
        return cls(
            device=device,
            bf16=use_bf16(cfg, device),
            param_dtype=param_dtype(cfg, device),
            micro_batch_size=micro_batch_size(cfg),
            stage_layers=tuple(stage_layers(cfg, device)),
            is_main=pc.is_main,
        )

    @property
    def param_precision(self) -> str:
        """`param_dtype` by the memory model's name (`trainer.plan.cost_model.BytesPerParam`)."""
        return precision_name(self.param_dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """A fresh context to compute under (bf16 autocast for fp32 parameters computing in bf16)."""
        return _autocast(self.device, self.bf16, self.param_dtype)


def build_model(cfg: TrainerConfig, pc: ParallelContext, facts: RunFacts | None = None) -> torch.nn.Module:
    """This rank's pipeline stage of the Llama model, tp-sharded, on pc.device, its blocks
    `facts.stage_layers` (the run's facts; resolved from `cfg` when not given)."""
    from trainer.model.llama import build_stage
    from trainer.model.moe import set_global_batch

    require_vocab_size(cfg)  # `auto` before the stores exist: one line, not a TypeError inside
    facts = facts or RunFacts.resolve(cfg, pc)
    stage = build_stage(cfg.model, cfg.parallelism, pc, facts.stage_layers[pc.pp_rank], seed=cfg.train.seed)
    set_global_batch(stage, cfg.train.global_batch_size)
    return stage.to(pc.device)
