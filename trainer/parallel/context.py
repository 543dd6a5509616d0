"""The process grid: world = pp x dp x tp, tp fastest varying (tensor-parallel neighbours share
a node), then dp, then pp. One object owns the groups and is passed explicitly."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.config.launch_env import launch_world_size, local_rank


def grid_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def grid_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def tied_stages(pp: int) -> list[int]:
    """The pipeline stages that hold a copy of the tied weight, `model.tie_embeddings`
    (trainer/parallel/tied.py; one stage when pp = 1)."""
    return sorted({0, pp - 1})


@dataclass
class ParallelContext:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    # The stages of one (dp, tp) position that hold the tied embedding (`trainer.parallel.tied`).
    tied_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def pp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[0]

    @property
    def dp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[1]

    @property
    def tp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the same (dp, tp) position on pipeline stage `pp_rank`."""
        return grid_rank(pp_rank, self.dp_rank, self.tp_rank, self.tp, self.dp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        return cls(device=torch.device(device))

    @classmethod
    def initialize(
        cls, tp: int = 1, pp: int = 1, dp: int = 1, backend: str = "auto", device: str = "auto"
    ) -> ParallelContext:
        """Join (or start) the process group from torchrun's environment and build the grid.

        With no torchrun environment and tp = pp = dp = 1, returns a single-process context. The
        launched world size must be tp x pp x dp: `trainer.build.init_parallel` checks it first.
        """
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device, local_rank()) if device == "cuda" else torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if launch_world_size() == 1 and not dist.is_initialized():
            return cls.single(dev)
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend, timeout=datetime.timedelta(minutes=10), device_id=dev if dev.type == "cuda" else None
            )
        return cls.from_process_group(tp, pp, dp, dev)

    @classmethod
    def from_process_group(cls, tp: int, pp: int, dp: int, device: torch.device) -> ParallelContext:
        """Build groups over an initialised default process group. Every rank creates every
        group in the same order, as `new_group` requires."""
        rank = dist.get_rank()
        ctx = cls(tp=tp, pp=pp, dp=dp, rank=rank, device=device)
        me_pp, me_dp, me_tp = grid_coords(rank, tp, dp)
        for p in range(pp):
            for d in range(dp):
                g = dist.new_group([grid_rank(p, d, t, tp, dp) for t in range(tp)])
                if (p, d) == (me_pp, me_dp):
                    ctx.tp_group = g
        for p in range(pp):
            for t in range(tp):
                g = dist.new_group([grid_rank(p, d, t, tp, dp) for d in range(dp)])
                if (p, t) == (me_pp, me_tp):
                    ctx.dp_group = g
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([grid_rank(p, d, t, tp, dp) for p in range(pp)])
                if (d, t) == (me_dp, me_tp):
                    ctx.pp_group = g
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([grid_rank(p, d, t, tp, dp) for p in tied_stages(pp)])
                if (d, t) == (me_dp, me_tp):
                    ctx.tied_group = g
        return ctx

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()
