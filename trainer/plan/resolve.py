"""The rules a config resolves by on a device: micro-batch size, compute precision and
parameter dtype. Pure functions of the config and the device, read by the plan (`doremi plan`
predicts what will run, `trainer.plan.memory`) and by the build (`trainer.build.RunFacts`
resolves them once per run)."""

from __future__ import annotations

import torch

from trainer.config.schema import TrainerConfig


def micro_batch_size(cfg: TrainerConfig) -> int:
    t = cfg.train
    return t.global_batch_size // (cfg.parallelism.dp * t.micro_batches)


def use_bf16(cfg: TrainerConfig, device: torch.device) -> bool:
    """Whether the run computes in bf16 (autocast): precision bf16, or auto on CUDA or with
    explicitly bf16 parameters (they compute in bf16 whatever autocast says)."""
    t = cfg.train
    return t.precision == "bf16" or (t.precision == "auto" and (device.type == "cuda" or t.param_dtype == "bf16"))


def param_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    """The dtype the model's parameters are stored in on `device` (train.param_dtype resolved):
    bf16 (with fp32 master weights) for bf16 compute with AdamW, fp32 otherwise."""
    t = cfg.train
    if t.param_dtype == "auto":
        return torch.bfloat16 if use_bf16(cfg, device) and t.optimizer == "adamw" else torch.float32
    return torch.bfloat16 if t.param_dtype == "bf16" else torch.float32


def param_precision(cfg: TrainerConfig, device: torch.device) -> str:
    """`param_dtype` by the name the memory model uses (`trainer.plan.cost_model.BytesPerParam`)."""
    return precision_name(param_dtype(cfg, device))


def precision_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"
