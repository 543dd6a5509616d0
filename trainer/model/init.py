"""Layout-independent initialisation.

Every parameter is drawn as its full single-process tensor from a generator seeded by
(seed, parameter name), then cut to this rank's tensor-parallel slice. A tp=2 / pp=2 model thus
holds exactly the slices of the single-process model with the same seed (on the same device
type: CPU and CUDA generators differ), and the copies of the tied `embed.weight` on the first
and last pipeline stages (`trainer.parallel.tied`) start equal.

Scheme: normal(0, init_std) for every matrix; the output projections (attention out, FFN down)
scaled by 1/sqrt(2 n_layers) when `depth_scaled_init` (GPT-2, Radford et al. 2019: one residual
branch per sublayer); norm weights one; padded vocabulary rows zero; under `model.mup.zero_init`
the head and the query rows zero (`trainer.model.mup.zero_rows`). Mamba-2's convolution,
dt_bias, A_log and D as mamba_ssm draws them (`trainer.model.mamba.mixer.mamba_full_tensor`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from trainer.model.mamba.mixer import mamba_full_tensor
from trainer.model.mup import init_multiplier, zero_rows
from trainer.parallel.expert import ep_full_shape, ep_slice
from trainer.parallel.shard import full_shape, get_shard_spec, shard

_OUTPUT_PROJECTIONS = (
    "attn.out.weight",
    "mlp.down.weight",
    "mamba.out_proj.weight",
    "mlp.experts.down",
    "shared.down.weight",
)
_VOCAB_MATRICES = ("embed.weight", "head.weight")


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for (seed, name) (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_std(name: str, cfg) -> float | None:
    """Standard deviation of a parameter's normal init; None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(_OUTPUT_PROJECTIONS) and cfg.depth_scaled_init:
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def full_tensor(name: str, shape: tuple[int, ...], cfg, seed: int, device: torch.device) -> torch.Tensor:
    """The single-process value of parameter `name` (fp32)."""
    std = init_std(name, cfg)
    if std is None:
        return torch.ones(shape, device=device)
    std *= init_multiplier(name, shape, cfg)
    gen = torch.Generator(device=device)
    gen.manual_seed(name_seed(seed, name))
    special = mamba_full_tensor(name, shape, cfg, gen, device)
    if special is not None:
        return special
    rows = cfg.vocab_size if name in _VOCAB_MATRICES else shape[0]
    out = torch.zeros(shape, device=device)
    out[:rows].normal_(0.0, std, generator=gen)
    out[: zero_rows(name, cfg)] = 0.0
    return out


@torch.no_grad()
def init_parameters(module: nn.Module, cfg, seed: int, tp_rank: int, tp: int) -> None:
    """Fill every parameter of `module` (named with global names) with its tp slice."""
    for name, param in module.named_parameters():
        full = full_tensor(name, ep_full_shape(param, full_shape(param)), cfg, seed, param.device)
        param.copy_(shard(ep_slice(full, param), get_shard_spec(param), tp_rank, tp))
