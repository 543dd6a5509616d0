"""How a tensor-parallel parameter is cut from its full (single-process) tensor.

A `ShardSpec(dim, parts)` says: along `dim`, the full tensor is the concatenation of `parts`
(sizes), and each part is split evenly over the tp ranks; rank r holds the concatenation of the
r-th chunk of every part. A plain column/row split is `parts=(size,)`. A fused QKV weight is
`parts=(q, k, v)` so each rank holds whole heads of each; a fused gate/up is `parts=(ffn, ffn)`.
Parameters without a spec are replicated over tp. Checkpoints and parity tests go through
`shard`/`unshard`, so a tensor saved at one tp loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SPEC_ATTR = "_tp_shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    parts: tuple[int, ...]

    def local_parts(self, world: int) -> tuple[int, ...]:
        for p in self.parts:
            if p % world:
                raise ValueError(f"shard part of size {p} is not divisible by tp={world}")
        return tuple(p // world for p in self.parts)


def shard(full: torch.Tensor, spec: ShardSpec | None, rank: int, world: int) -> torch.Tensor:
    """The slice of `full` that tp rank `rank` of `world` holds."""
    if spec is None or world == 1:
        return full
    pieces = torch.split(full, list(spec.parts), dim=spec.dim)
    local = [p.chunk(world, dim=spec.dim)[rank] for p in pieces]
    return torch.cat(local, dim=spec.dim).contiguous()


def unshard(shards: list[torch.Tensor], spec: ShardSpec | None) -> torch.Tensor:
    """Inverse of `shard` given every rank's slice in rank order."""
    if spec is None or len(shards) == 1:
        return shards[0]
    world = len(shards)
    local = spec.local_parts(world)
    per_rank = [torch.split(s, list(local), dim=spec.dim) for s in shards]
    parts = [torch.cat([per_rank[r][i] for r in range(world)], dim=spec.dim) for i in range(len(local))]
    return torch.cat(parts, dim=spec.dim)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The single-process shape of a tp-local parameter."""
    spec = get_shard_spec(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = sum(spec.parts)
    return tuple(shape)


def set_shard_spec(param: torch.Tensor, spec: ShardSpec | None) -> None:
    setattr(param, _SPEC_ATTR, spec)


def get_shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, _SPEC_ATTR, None)
