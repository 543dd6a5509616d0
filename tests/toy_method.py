"""A mixing method written for the tests, in one file outside trainer/: it reads every signal the
interface offers but gradient alignment (this step's per-token statistics before the backward,
validation losses on its own schedule, random draws) and keeps its state in checkpoints, so that
a test can check that the trainer supplies them the same under every layout."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from doremi.methods.log import MethodLog
from trainer.run.hooks import MethodBase, MethodContext, Needs, StepSignals


class LossChaser(MethodBase):
    """Draws domains at random in proportion to exp(last validation loss); weights this step's
    objective by each domain's mean squared token loss of this step (known only after every
    forward). Validation every second step."""

    needs = Needs(token_stats=1, stats_before_backward=True, draws="random", validation=True)

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx
        self.val = np.zeros(ctx.k)
        self.weights = np.full(ctx.k, 1.0 / ctx.k)
        self.log = MethodLog(ctx)

    def sampling_weights(self, step: int) -> np.ndarray:
        p = np.exp(self.val - self.val.max())
        return p / p.sum()

    def token_stats(self, losses: torch.Tensor, batch: dict) -> list[torch.Tensor]:
        return [losses.double() ** 2]

    def loss_weights(self, step: int, signals: StepSignals | None) -> torch.Tensor | None:
        assert signals is not None and signals.stats is not None
        w = signals.stats[0] / signals.tokens.clamp_min(1)
        self.weights = (w / w.sum()).cpu().numpy()
        return w / w.sum()

    def validation_due(self, step: int) -> bool:
        return step % 2 == 0

    def observe_validation(self, step: int, losses: torch.Tensor) -> None:
        self.val = losses.cpu().numpy()

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        self.log.append(
            step,
            {
                "weights": self.weights.tolist(),
                "tokens": signals.tokens.tolist(),
                "sampling": signals.weights.tolist(),
                "sequences": signals.sequences.tolist(),
                "loss": signals.domain_loss.tolist(),
            },
        )
        return {"domain_weights": dict(zip(self.ctx.domains, self.weights.tolist()))}

    def state_dict(self) -> dict[str, Any]:
        return {"val": self.val.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.val = np.array(state["val"])

    def close(self) -> None:
        self.log.close()
