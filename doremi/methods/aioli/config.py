"""The options of Aioli (`mixing.aioli`); the method itself is in method.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.tools import ConfigError


@dataclass
class AioliConfig:
    """Aioli (Chen et al. 2025): mixing-law parameters estimated online from short probes, and an
    exponentiated-gradient step on the mixture each round."""

    # `authors`: the released code as its scripts run it (--ema: each round restarts from the
    # uniform prior, p_r proportional to exp(eta colsum(Abar_r))); `paper`: Algorithm 1 (p_r
    # proportional to p_{r-1} exp(eta colsum(Abar_r))). doremi/methods/aioli/method.py lists the differences.
    variant: Literal["authors", "paper"] = "authors"
    # Step size eta of the exponentiated-gradient update of the mixture (the authors' examples:
    # 0.1 to 0.5).
    eta: float = 0.2
    # Number of rounds T: each re-estimates A and updates the mixture (round length
    # ceil(train.steps / rounds)).
    rounds: int = 20
    # The authors' `--update_steps`: steps per round; when set, `rounds` is ignored.
    round_steps: int | None = None
    # Steps of each probe interval (the authors' `--lp_steps`).
    delta: int = 4
    # Passes over the k domains in each round's LearnParams (the authors' `--lp_rounds`).
    sweeps: int = 4
    # Mass a probe mixture spreads evenly over the other domains (the authors' 1 - one_hot_factor;
    # 0: exact one-hot probes). Must be below (k - 1) / k.
    one_hot_eps: float = 0.25
    # Weight of the previous smoothed A in its exponential moving average (0: no smoothing).
    ema: float = 0.1
    # Shift A to be non-negative and scale it to sum 1 before smoothing (the authors' `--aioli_normalize_A`).
    normalize: bool = True
    # Keep only A's diagonal, estimated as D[i, i] / (1 - one_hot_eps) (the authors' `--aioli_diagonal`).
    diagonal: bool = False
    # Each sweep probes the domains in a random order drawn from the run's seed and the round (the
    # authors' code); false: in domain order.
    shuffle: bool = True
    # Validation sequences per domain of each of the method's validation passes (the same first
    # ones every pass; 0: the whole split, as the authors' code); None: the largest number (at
    # least 1) that keeps all passes within `eval_budget` of the run's training FLOPs.
    eval_sequences: int | None = None
    # The share of the run's training FLOPs its validation passes may take when eval_sequences is None.
    eval_budget: float = 0.1

    def validate(self, path: str = "mixing.aioli") -> None:
        if not 0 <= self.eta < float("inf"):
            raise ConfigError(f"{path}.eta: expected a finite value >= 0, got {self.eta}")
        if self.rounds < 1:
            raise ConfigError(f"{path}.rounds: expected >= 1, got {self.rounds}")
        if self.round_steps is not None and self.round_steps < 2:
            raise ConfigError(f"{path}.round_steps: expected >= 2 or null, got {self.round_steps}")
        if self.delta < 1:
            raise ConfigError(f"{path}.delta: expected >= 1, got {self.delta}")
        if self.sweeps < 1:
            raise ConfigError(f"{path}.sweeps: expected >= 1, got {self.sweeps}")
        if not 0 <= self.one_hot_eps < 1:
            raise ConfigError(f"{path}.one_hot_eps: expected a value in [0, 1), got {self.one_hot_eps}")
        if not 0 <= self.ema < 1:
            raise ConfigError(f"{path}.ema: expected a value in [0, 1), got {self.ema}")
        if self.variant not in ("authors", "paper"):
            raise ConfigError(f"{path}.variant: expected 'authors' or 'paper', got {self.variant!r}")
        if self.eval_sequences is not None and self.eval_sequences < 0:
            raise ConfigError(f"{path}.eval_sequences: expected >= 0 or null, got {self.eval_sequences}")
        if not 0 < self.eval_budget < float("inf"):
            raise ConfigError(f"{path}.eval_budget: expected a finite value > 0, got {self.eval_budget}")
