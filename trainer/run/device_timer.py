"""Seconds a stretch of work took on its device, not on the host's clock.

Why not `time.perf_counter()` around it: the host runs ahead of a CUDA device (it queues the
training step's kernels and goes on), so a host clock started at a method's validation pass also
counts the queued training work the pass's first host read waits for. At 1B on one H100 that
put Aioli's per-step validation cost above its true GPU time and its training step, with the
passes subtracted, at 1.034 of a plain step (experiments/results/gpu_session18). CUDA events
recorded on the stream before and after the work measure what the work itself occupied, and
reading them costs no synchronisation where the work ends with a host read anyway (a validation
pass returns its losses to the host). On the CPU the host clock is the device's."""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """`with timer:` around the work, then `timer.seconds()`. On CUDA: the elapsed time between
    two events recorded on the current stream (`seconds()` waits for the second, which a pass
    that ended with a host read has already passed); elsewhere the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start: torch.cuda.Event | float | None = None
        self._end: torch.cuda.Event | float | None = None

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        if self._start is None or self._end is None:
            raise RuntimeError("DeviceTimer.seconds: the timed block has not ended")
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start
