"""The options of ADO (`mixing.ado`); the method itself is in method.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainer.config.tools import ConfigError

#: What `count`, `credit`, `average` and `floor_on` are when left null, per variant.
VARIANT_CHOICES: dict[str, dict[str, str]] = {
    "authors": {"count": "total", "credit": "counts", "average": "preference", "floor_on": "preference"},
    "paper": {"count": "domain", "credit": "policy", "average": "policy", "floor_on": "policy"},
}


@dataclass
class ADOConfig:
    """ADO (Jiang et al. 2024): per-domain power laws of the training loss, refit during the run,
    steer the mixture towards the domains whose loss still falls fastest."""

    # Steps on the natural mixture before anything is fitted; their losses are left out of the
    # fits (the authors' `ignore_steps` and `start_step`: 1000).
    warmup: int = 1000
    # Steps between refits (the authors' `update_interval`: 1000). `paper`: after every step
    # t > warmup with (t - warmup) a multiple of this; `authors`: after every step t with
    # t - 1 >= warmup and (t - 1) a multiple of this (their 0-based steps).
    refit_every: int = 1000
    # `paper`: steps per history point (a block mean); `authors`: the stride of the smoothed
    # steps kept for the fit (theirs: 10). Must divide refit_every.
    record_every: int = 10
    # `paper`: most history points per domain: beyond it adjacent pairs are merged.
    max_points: int = 256
    # `paper`: fewest history points a domain needs to be fitted (3 parameters).
    min_points: int = 5
    # gamma1: weight of the newest policy (or counts) in the moving average h of the credit
    # assignment (the authors' 1 - 0.9).
    credit_smoothing: float = 0.1
    # s: the credit assignment is lambda_k = h_k^s.
    credit_exponent: float = 0.5
    # gamma2: weight of the preference rho(t) in the policy; the rest is the time average pibar.
    policy_mix: float = 0.1
    # delta_min: smallest probability of a domain with training data (at most 1 / their number).
    floor: float = 0.01
    # `paper`: largest exponent alpha of a fit (`authors`: their soft bound 0.8).
    alpha_max: float = 0.8
    # Huber threshold on the log residuals of the `paper` variant's fit; null: least squares
    # (the `authors` fit always uses their 1e-3).
    huber_delta: float | None = None
    # `authors`: the released code (yidingjiang/ado @ bc3d8d0): per-step history smoothed by
    # Savitzky-Golay, their soft-bounded multi-start fit, their refit schedule, random draws and
    # the four choices below as theirs. `paper`: section 3's form with our block-mean history and
    # bounded fit (module docstring).
    variant: Literal["authors", "paper"] = "authors"
    # n of a domain: `domain`: its own sequences seen (the paper); `total`: all sequences seen
    # (the authors' `use_same_step_size`). null: the variant's (authors: total; paper: domain).
    count: Literal["domain", "total"] | None = None
    # h averages `policy`: the policies used (the paper), or `counts`: each batch's realised
    # count distribution (the authors' code). null: the variant's.
    credit: Literal["policy", "counts"] | None = None
    # The time average pibar is of the `policy` used so far (the paper), or of the `preference`
    # rho (the authors' `p_avg`). null: the variant's.
    average: Literal["policy", "preference"] | None = None
    # The floor applies to the `policy` (exactly, the paper's minimum probability) or to the
    # `preference` rho by clip-and-renormalise (the authors' code). null: the variant's.
    floor_on: Literal["policy", "preference"] | None = None

    def choice(self, name: str) -> str:
        """`count`, `credit`, `average` or `floor_on` as set, or else the variant's."""
        value = getattr(self, name)
        return VARIANT_CHOICES[self.variant][name] if value is None else value

    def validate(self, path: str = "mixing.ado") -> None:
        for name in ("warmup", "refit_every", "record_every", "max_points", "min_points"):
            value = getattr(self, name)
            low = 0 if name == "warmup" else 3 if name == "min_points" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{path}.{name}: expected an integer >= {low}, got {value!r}")
        if self.refit_every % self.record_every:
            raise ConfigError(
                f"{path}.refit_every: expected a multiple of record_every ({self.record_every}), got {self.refit_every}"
            )
        if self.max_points < max(self.min_points, 2):
            raise ConfigError(
                f"{path}.max_points: expected >= min_points ({self.min_points}) and >= 2, got {self.max_points}"
            )
        for name, lo_open in (("credit_smoothing", True), ("policy_mix", False)):
            value = getattr(self, name)
            if not ((0 < value <= 1) if lo_open else (0 <= value <= 1)):
                interval = "(0, 1]" if lo_open else "[0, 1]"
                raise ConfigError(f"{path}.{name}: expected a value in {interval}, got {value}")
        if not 0 <= self.credit_exponent < math.inf:
            raise ConfigError(f"{path}.credit_exponent: expected a finite value >= 0, got {self.credit_exponent}")
        if not 0 <= self.floor < 1:
            raise ConfigError(f"{path}.floor: expected a value in [0, 1), got {self.floor}")
        if not 0 < self.alpha_max < math.inf:
            raise ConfigError(f"{path}.alpha_max: expected a finite value > 0, got {self.alpha_max}")
        if self.huber_delta is not None and not 0 < self.huber_delta < math.inf:
            raise ConfigError(f"{path}.huber_delta: expected a finite value > 0 or null, got {self.huber_delta}")
        if self.variant not in ("authors", "paper"):
            raise ConfigError(f"{path}.variant: expected one of 'authors', 'paper', got {self.variant!r}")
        for name, allowed in (
            ("count", ("domain", "total")),
            ("credit", ("policy", "counts")),
            ("average", ("policy", "preference")),
            ("floor_on", ("policy", "preference")),
        ):
            if getattr(self, name) not in (None, *allowed):
                raise ConfigError(
                    f"{path}.{name}: expected one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}"
                )
