"""The options of ODM (`mixing.odm`); the method itself is in method.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.tools import ConfigError

REWARDS = ("loss", "exp_loss")
ESTIMATORS = ("smoothed", "cumulative")
POLICIES = ("softmax", "linear")
INITIAL_WEIGHTS = ("uniform", "tokens")
DRAW_UNITS = ("sequence", "batch")


@dataclass
class ODMConfig:
    """ODM (Albalak et al. 2023, Algorithm 1): EXP3 over domains, rewarded by the training loss."""

    # Smoothing alpha of the estimated reward: R_hat <- alpha R_hat + (1 - alpha) reward (the
    # authors' default 0.9; 0.5 in some of their runs). Unused by `estimator: cumulative`.
    smoothing: float = 0.9
    # `loss`: a drawn domain's reward is its mean training loss (the paper); `exp_loss`: exp of it
    # (the authors' `SmoothedMeanWeightUpdater`).
    reward: Literal["loss", "exp_loss"] = "loss"
    # Divide the reward by the domain's sampling probability pi_t(i) (the paper); false: the
    # authors' `SmoothedMeanWeightUpdater`.
    importance_weighting: bool = True
    # Factor on every reward (the authors' `Exp3WeightUpdater`: 0.1).
    reward_scale: float = 1.0
    # `smoothed`: the moving average of the rewards (the paper); `cumulative`: their sum (plain
    # EXP3, the authors' `Exp3WeightUpdater`).
    estimator: Literal["smoothed", "cumulative"] = "smoothed"
    # `softmax`: the Gibbs policy exp(eps_{t-1} R_hat) normalised (the paper); `linear`: R_hat
    # normalised (the authors' mixed-batch update).
    policy: Literal["softmax", "linear"] = "softmax"
    # 0: step t draws with eps_t and temperature eps_{t-1} (the paper); 1: with eps_{t-1} and
    # eps_{t-2} (the authors' code, which updates the policy after each step with that step's eps).
    epsilon_lag: int = 0
    # Steps drawn from `initial_weights` before the bandit starts, without reward updates (the
    # paper: 0; the authors' scripts: 2000).
    warmup_steps: int = 0
    # The weights of the warmup steps: `uniform` or `tokens` (each domain's share of the training
    # tokens, the natural mixture).
    initial_weights: Literal["uniform", "tokens"] = "uniform"
    # `sequence`: each sequence of the global batch draws its domain from pi_t; `batch`: the whole
    # batch comes from one domain drawn from pi_t (one bandit pull per step, as in Algorithm 1).
    draw_unit: Literal["sequence", "batch"] = "sequence"

    def validate(self, path: str = "mixing.odm") -> None:
        if not 0 <= self.smoothing < 1:
            raise ConfigError(f"{path}.smoothing: expected a value in [0, 1), got {self.smoothing}")
        if self.reward not in REWARDS:
            raise ConfigError(f"{path}.reward: expected one of {', '.join(REWARDS)}, got {self.reward!r}")
        if not isinstance(self.importance_weighting, bool):
            raise ConfigError(f"{path}.importance_weighting: expected true or false, got {self.importance_weighting!r}")
        if not 0 < self.reward_scale < float("inf"):
            raise ConfigError(f"{path}.reward_scale: expected a finite value > 0, got {self.reward_scale}")
        if self.estimator not in ESTIMATORS:
            raise ConfigError(f"{path}.estimator: expected one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"{path}.policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.epsilon_lag not in (0, 1) or isinstance(self.epsilon_lag, bool):
            raise ConfigError(f"{path}.epsilon_lag: expected 0 or 1, got {self.epsilon_lag!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"{path}.warmup_steps: expected an integer >= 0, got {self.warmup_steps!r}")
        if self.initial_weights not in INITIAL_WEIGHTS:
            raise ConfigError(
                f"{path}.initial_weights: expected one of {', '.join(INITIAL_WEIGHTS)}, got {self.initial_weights!r}"
            )
        if self.draw_unit not in DRAW_UNITS:
            raise ConfigError(f"{path}.draw_unit: expected one of {', '.join(DRAW_UNITS)}, got {self.draw_unit!r}")
