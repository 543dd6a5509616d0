"""The proxy's mixing signals in its metrics rows (and so in wandb): per domain, the excess loss
that drives the update and the reference loss it is measured against, beside the weights the
hook already returns. `domain_weights.jsonl` keeps the full history either way."""

from __future__ import annotations

from typing import Any

from doremi.objective import DoReMiHook
from trainer.step import StepStats


class SignalsLoggedHook(DoReMiHook):
    def after_step(self, step: int, stats: StepStats) -> dict[str, Any]:
        row = super().after_step(step, stats)
        if self.pc.is_main:
            ref = (self.ref_sums[0] / self.ref_sums[1].clamp_min(1)).tolist()
            row["excess_loss"] = dict(zip(self.domains, self.excess.tolist()))
            row["reference_loss"] = dict(zip(self.domains, ref))
        return row
