"""`trainer.run.device_timer.DeviceTimer`: the host's clock on the CPU (the CUDA path, events on
the stream, is checked in tests/test_gpu.py against queued work it must not count)."""

from __future__ import annotations

import pytest
import torch

from trainer.run import device_timer
from trainer.run.device_timer import DeviceTimer


def test_on_the_cpu_it_reads_the_hosts_clock_at_the_blocks_ends(monkeypatch):
    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(device_timer.time, "perf_counter", lambda: next(ticks))
    with DeviceTimer(torch.device("cpu")) as timer:
        pass
    assert timer.seconds() == 2.5


def test_seconds_before_the_block_ends_is_refused():
    timer = DeviceTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="has not ended"):
        timer.seconds()
