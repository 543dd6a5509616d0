"""The `model.mup` config (`MupConfig`); the spectral muP rules it switches on are
`trainer.model.mup`'s. A config module, so that `trainer.config.schema` holds it without
importing the model."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.tools import ConfigError


@dataclass
class MupConfig:
    """Spectral muP: init, per-layer learning rates and multipliers relative to a base width."""

    # The d_model at which init_std and train.lr were tuned (the model there equals the model
    # without muP).
    base_width: int = 256

    def validate(self, path: str = "model.mup") -> None:
        if self.base_width < 1:
            raise ConfigError(f"{path}.base_width: expected a positive int, got {self.base_width}")
