"""`model.init_from_hf`: a run's initial weights from a Hugging Face Llama directory, at any
layout.

Each rank reads, from the directory's safetensors, the HF tensors of its own stage's parameters,
builds each full parameter (`trainer.hf.format.our_tensor`: fused projections concatenated,
vocabulary padded to the layout's padded size) and keeps its tensor-parallel slice, exactly as
the random initialisation does (`trainer.model.init`). It runs before the optimizer is built,
so that bf16 runs take their fp32 masters from these weights, and not when the run resumes from
its own checkpoint (those weights win, and the directory may be gone by then).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.architecture import ARCH_KEYS
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.hf.files import CONFIG, HFDir
from trainer.hf.format import HFFormatError, check_plain_llama, model_keys_from_hf, our_tensor
from trainer.parallel.context import ParallelContext
from trainer.parallel.shard import full_shape, get_shard_spec, shard


def check_model_config(cfg: Any, hf_keys: dict[str, Any], where: str) -> None:
    """The run's `model` keys must be the HF model's (`ARCH_KEYS`); one line naming those that differ."""
    ours = dataclasses.asdict(cfg)
    diff = [
        f"model.{k} is {ours.get(k)!r} but {hf_keys.get(k)!r} there" for k in ARCH_KEYS if ours.get(k) != hf_keys.get(k)
    ]
    if diff:
        raise HFFormatError(f"model.init_from_hf: {where}: {'; '.join(diff)} (doremi import prints the model section)")


def will_resume(cfg: Any, run_dir: Path) -> bool:
    """Whether the run starts from a checkpoint (its own, or `checkpoint.load`) that overwrites
    the initial weights anyway."""
    return bool(cfg.checkpoint.load) or (cfg.checkpoint.resume and latest_checkpoint(run_dir) is not None)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, cfg: Any, hf_dir: str | Path, pc: ParallelContext) -> None:
    """Fill this rank's stage `model` (config `cfg`, the `model` section) from `hf_dir`."""
    check_plain_llama(cfg, "model.init_from_hf")
    hf = HFDir(hf_dir)
    check_model_config(cfg, model_keys_from_hf(hf.config, str(hf.path / CONFIG)), str(hf.path / CONFIG))
    for name, param in model.named_parameters():
        full = our_tensor(name, hf.get, cfg, rows=full_shape(param)[0])
        if tuple(full.shape) != full_shape(param):
            raise HFFormatError(f"{hf.path}: {name} has shape {tuple(full.shape)}, the model {full_shape(param)}")
        param.copy_(shard(full, get_shard_spec(param), pc.tp_rank, pc.tp))


def init_from_hf(model: torch.nn.Module, cfg: Any, pc: ParallelContext, run_dir: Path) -> None:
    """`model.init_from_hf` for a training run (`cfg`: the whole config): load it unless unset
    or the run starts from a checkpoint."""
    if cfg.model.init_from_hf and not will_resume(cfg, run_dir):
        load_hf_weights(model, cfg.model, cfg.model.init_from_hf, pc)
