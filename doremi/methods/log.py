"""The common per-step log of a mixing method: `domain_weights.jsonl` (format: doremi.methods.history),
written by global rank 0 only, so that `doremi average` turns any method's run into a weights
JSON the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from doremi.methods.history import WeightHistory
from trainer.run.hooks import MethodContext


class MethodLog:
    """Opened at the first step this process logs: lines of steps >= it (left by an
    interrupted run) are dropped, so a resumed run's log equals an uninterrupted one's."""

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx
        self._history: WeightHistory | None = None

    def append(self, step: int, record: Mapping[str, Any]) -> None:
        """`record`: `weights`, `tokens` and the method's per-domain signals (rank 0 writes)."""
        if not self.ctx.is_main:
            return
        if self._history is None:
            self._history = WeightHistory(self.ctx.run_dir, resume_step=step - 1)
        self._history.append({"step": step, "domains": self.ctx.domains, **record})

    def close(self) -> None:
        if self._history is not None:
            self._history.close()
