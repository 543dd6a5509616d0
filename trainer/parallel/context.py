"""The process grid: world = pp x dp x tp, tp fastest varying (tensor-parallel neighbours share
a node), then dp, then pp; the expert-parallel groups are carved from the dp ranks
(`trainer.parallel.expert`). One object makes and owns every process group, and is passed
explicitly: nothing else calls `new_group`."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.config.launch_env import launch_world_size, local_rank


def resolve_device(device: str, backend: str, group_backend: str | None) -> str:
    """The device `train.device` names for this process. `auto`: CUDA when available, except in a
    gloo process group made before the trainer joins it, with `parallelism.backend` auto (the
    tests' CPU ranks, tests/distributed.py): its ranks compute on the CPU, as the group does,
    whatever GPUs the machine has (gloo has no CUDA reduce-scatter or all-to-all, and one GPU
    cannot be every rank's). A run that makes its own group (torchrun), or joins one the trainer
    made (a pipeline's later stages), or names its backend, chooses as it always did."""
    if device != "auto":
        return device
    if group_backend == "gloo" and backend == "auto":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def grid_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def grid_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def tied_stages(pp: int) -> list[int]:
    """The pipeline stages that hold a copy of the tied weight, `model.tie_embeddings`
    (trainer/parallel/tied.py; one stage when pp = 1)."""
    return sorted({0, pp - 1})


def grid_groups(tp: int, pp: int, dp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every group of the grid as lists of global ranks, kind by kind in the order they are
    made: tp (per stage and dp rank), dp (per stage and tp rank), pp (per dp and tp rank), tied
    (the `tied_stages` of each dp and tp rank); with ep > 1, ep (blocks of ep consecutive dp
    ranks) and ep_replica (the dp ranks holding the same experts: d % ep equal), per stage and
    tp rank."""

    def r(p: int, d: int, t: int) -> int:
        return grid_rank(p, d, t, tp, dp)

    groups = {
        "tp": [[r(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[r(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[r(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "tied": [[r(p, d, t) for p in tied_stages(pp)] for d in range(dp) for t in range(tp)],
    }
    if ep > 1:
        stages = [(p, t) for p in range(pp) for t in range(tp)]
        groups["ep"] = [[r(p, b * ep + i, t) for i in range(ep)] for p, t in stages for b in range(dp // ep)]
        groups["ep_replica"] = [[r(p, i + j * ep, t) for j in range(dp // ep)] for p, t in stages for i in range(ep)]
    return groups


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
    #: Expert parallel (`parallelism.ep`, `trainer.parallel.expert.ExpertParallel.from_context`):
    #: this rank's ep group, and the replica group of its experts with its members' global ranks.
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None
    ep_replica_group: dist.ProcessGroup | None = None
    ep_replica_ranks: list[int] = field(default_factory=list)

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
        cls, tp: int = 1, pp: int = 1, dp: int = 1, backend: str = "auto", device: str = "auto", ep: int = 1
    ) -> ParallelContext:
        """Join (or start) the process group from torchrun's environment and build the grid.

        With no torchrun environment and tp = pp = dp = 1, returns a single-process context. The
        launched world size must be tp x pp x dp: `trainer.build.init_parallel` checks it first.
        """
        device = resolve_device(device, backend, dist.get_backend() if dist.is_initialized() else None)
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
        return cls.from_process_group(tp, pp, dp, dev, ep)

    @classmethod
    def from_process_group(cls, tp: int, pp: int, dp: int, device: torch.device, ep: int = 1) -> ParallelContext:
        """Build groups over an initialised default process group (`grid_groups`). Every rank
        creates every group in the same order, as `new_group` requires."""
        ctx = cls(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), device=device, ep=ep)
        for kind, members in grid_groups(tp, pp, dp, ep).items():
            for ranks in members:
                group = dist.new_group(ranks)
                if ctx.rank in ranks:
                    setattr(ctx, f"{kind}_group", group)
                    if kind == "ep_replica":
                        ctx.ep_replica_ranks = ranks
        return ctx

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()
