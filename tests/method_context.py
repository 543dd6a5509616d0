"""The run a method's unit tests plug it into: one CPU process, seed 0 (trainer/run/hooks.py
MethodContext), so that each method's tests name only what their numbers depend on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.parallel.context import ParallelContext
from trainer.run.hooks import MethodContext


def method_context(
    run_dir: Path,
    domains: Sequence[str],
    steps: int,
    batch: int,
    seq_len: int,
    train_tokens: Sequence[int],
    is_main: bool = True,
) -> MethodContext:
    """A single-process CPU context of `steps` steps of `batch` sequences of `seq_len` tokens."""
    return MethodContext(
        list(domains),
        run_dir,
        is_main,
        torch.device("cpu"),
        0,
        steps,
        batch,
        seq_len,
        list(train_tokens),
        pc=ParallelContext.single(),
    )
