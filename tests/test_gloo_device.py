"""The multi-process tests' ranks compute on the CPU on a machine with GPUs too: their gloo
group is made before the trainer joins it (tests/distributed.py), and `train.device: auto` then
resolves to the CPU (`trainer.parallel.context.resolve_device`); a run that makes its own group
chooses CUDA as before. Seen on the GPU machine, where the gloo tests had picked CUDA."""

from __future__ import annotations

import torch

from tests.distributed import spawn
from trainer.parallel.context import ParallelContext, resolve_device


def test_auto_is_the_cpu_in_a_gloo_group_made_before_and_cuda_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", "auto", "gloo") == "cpu"  # the tests' ranks
    assert resolve_device("auto", "auto", None) == "cuda"  # torchrun: the trainer makes the group
    assert resolve_device("auto", "auto", "nccl") == "cuda"  # a pipeline's later stage on GPUs
    assert resolve_device("auto", "gloo", "gloo") == "cuda"  # a backend named: as it always was
    assert resolve_device("cuda", "auto", "gloo") == "cuda" and resolve_device("cpu", "auto", None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", "auto", None) == "cpu"


def _initialize_where_cuda_looks_available(rank: int, world: int) -> None:
    torch.cuda.is_available = lambda: True  # this rank only: it exits after the test
    pc = ParallelContext.initialize(dp=world)
    assert pc.device == torch.device("cpu") and pc.rank == rank and pc.dp == world


def test_the_spawned_gloo_ranks_get_the_cpu_where_cuda_is_available():
    spawn(_initialize_where_cuda_looks_available, 2)
