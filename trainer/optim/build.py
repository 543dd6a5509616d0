"""`build_optimizer`: the optimizer for a run's resolved parameter dtype (`trainer.optim`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import Parameter

from trainer.config.schema import TrainConfig
from trainer.optim.interface import Optimizer
from trainer.optim.master_weights import MasterWeightAdamW
from trainer.optim.sharded import ShardedOptimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.data_parallel import DEFAULT_BUCKET_NUMEL


def build_optimizer(
    named_params: Sequence[tuple[str, Parameter]],
    cfg: TrainConfig,
    pc: ParallelContext,
    zero1: bool,
    param_dtype: torch.dtype = torch.float32,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> Optimizer:
    """The optimizer for this rank's trainable parameters (global names, tp-local tensors).
    `param_dtype` bf16 turns the (fp32) parameters into bf16 views of the master-weight
    optimizer's flat buffer; build it before anything else captures the parameters' storage."""
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    if param_dtype == torch.float32:
        return ShardedOptimizer(trainable, cfg, pc, zero1, bucket_numel)
    if param_dtype != torch.bfloat16:
        raise ValueError(f"build_optimizer: parameters are trained in fp32 or bf16, got {param_dtype}")
    return MasterWeightAdamW(trainable, cfg, pc, zero1=zero1, bucket_numel=bucket_numel)
