"""What a data-mixing method plugs into the trainer (docs/design.md section 2).

The loop asks the hook, each step: which domain weights the sampler draws with; whether to
attach anything to the micro-batches (e.g. reference losses); which `LossWeighting` turns
per-token losses into the objective; and, after the update, what to log. The hook's state is
checkpointed with the run. Plain training is `FixedMixture`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from trainer.step import StepStats
from trainer.weighting import LossWeighting, MeanTokenLoss


class MixingHook(Protocol):
    def sampling_weights(self, step: int) -> np.ndarray: ...

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None: ...

    def weighting(self, step: int, micro_batches: list[dict], domain_tokens: torch.Tensor) -> LossWeighting: ...

    def after_step(self, step: int, stats: StepStats) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class FixedMixture:
    """Sample with fixed domain weights; minimise the mean per-token loss."""

    def __init__(self, weights: np.ndarray):
        self.weights = np.asarray(weights, dtype=np.float64)

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.weights

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None:
        pass

    def weighting(self, step: int, micro_batches: list[dict], domain_tokens: torch.Tensor) -> LossWeighting:
        return MeanTokenLoss(domain_tokens.sum())

    def after_step(self, step: int, stats: StepStats) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
