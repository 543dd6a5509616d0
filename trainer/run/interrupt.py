"""SIGINT and SIGTERM as a request to stop at the next step boundary, with a checkpoint.

A preempted or interrupted job saves where it is and exits with 128 + the signal number (130
for SIGINT, 143 for SIGTERM, as a shell reports a process killed by it), so that the same command
resumes. The signal is acknowledged at once with a line on stderr (rank 0), saying where the run
will stop. A single process stops at the next step boundary (its flag is a host variable: free to
read). Under torchrun every rank gets the signal, but not at the same step: the ranks agree,
with one all-reduce at each logging step (`logging.every`, where the loop reads the device anyway),
so that all save at the same step or none; a signal is acted on within `logging.every` steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.parallel.context import ParallelContext

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped on a signal after saving; `status` is the exit status the CLI returns."""

    def __init__(self, signum: int, step: int, run_dir: str):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        self.status = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"{name}: saved {run_dir} at step {step}; the same command resumes")


class StopRequests:
    """The signal received since `installed()` began, if any (a second one kills as before).
    `every`: the steps between the boundaries where the loop acts on it (1: the next step);
    `announce`: print the acknowledgment (rank 0)."""

    def __init__(self, announce: bool = True, every: int = 1) -> None:
        self.signum = 0
        self.announce, self.every = announce, every

    def acknowledgment(self, signum: int) -> str:
        name = signal.Signals(signum).name
        where = "the next step" if self.every == 1 else f"the next multiple of {self.every} steps (logging.every)"
        return f"{name} received: saving a checkpoint and stopping at {where}; {name} again stops at once, unsaved"

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.signum = signum
        if self.announce:  # os.write: safe in a handler that may interrupt a print
            os.write(2, (self.acknowledgment(signum) + "\n").encode())

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers live in the main thread only
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def agreed(self, pc: ParallelContext) -> int:
        """The signal any rank has received (0: none), the same on every rank."""
        if not pc.distributed:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int32, device=pc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
