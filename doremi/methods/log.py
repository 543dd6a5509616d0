"""The common per-step log of a mixing method: `domain_weights.jsonl` (format: doremi.methods.history),
written by global rank 0 only, so that `doremi average` turns any method's run into a weights
JSON the same way.

A record may hold tensors on the device (DoReMi's and DoGE's weights and signals): it is kept as
it is and written at the next `flush`, which the trainer calls where it reads the device anyway
(its logging steps, before a checkpoint) and `close` calls last. Reading them at each step
would make the host wait for the device at every step's end, with the next step's host work
(sampling, collation, the launches) exposed while the GPU idles (docs/design.md section 7)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from doremi.methods.history import WeightHistory
from trainer.run.hooks import MethodContext


class MethodLog:
    """Opened at the first step this process writes: lines of steps >= it (left by an
    interrupted run) are dropped, so a resumed run's log equals an uninterrupted one's."""

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx
        self._history: WeightHistory | None = None
        self._pending: list[tuple[int, Mapping[str, Any]]] = []

    def append(self, step: int, record: Mapping[str, Any]) -> None:
        """`record`: `weights`, `tokens` and the method's per-domain signals (rank 0 writes).
        Host values are written at once (after any record still pending); a record holding a
        tensor waits for `flush`. The tensors must not change in place after this call."""
        if not self.ctx.is_main:
            return
        self._pending.append((step, record))
        if not any(isinstance(v, torch.Tensor) for v in record.values()):
            self.flush()

    def flush(self) -> None:
        """Write the pending records, in step order (their tensors read on the host)."""
        if not self._pending:
            return
        if self._history is None:
            self._history = WeightHistory(self.ctx.run_dir, resume_step=self._pending[0][0] - 1)
        for step, record in self._pending:
            host = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in record.items()}
            self._history.append({"step": step, "domains": self.ctx.domains, **host})
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        if self._history is not None:
            self._history.close()
