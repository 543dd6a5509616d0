"""The options of DoReMi (`mixing.doremi`; before the catalog, the top-level `doremi` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from data.config import PathStr, Weights
from trainer.config.fp8 import require_torchao
from trainer.config.tools import ConfigError


@dataclass
class DoReMiConfig:
    """DoReMi (Xie et al. 2023, Algorithm 1). docs/design.md section 4 states every choice."""

    # Step size of the exponentiated-gradient update of the domain weights alpha.
    eta: float = 1.0
    # Mix of alpha with the uniform distribution after each update (c in the paper).
    smoothing: float = 1e-3
    # Reference run directory (or a checkpoint directory) for `train-proxy` and `score`.
    reference: PathStr | None = None
    # Weights the reference trains on (`train-reference` ignores data.domain_weights): `uniform`,
    # `tokens`, a weights JSON, or values.
    reference_weights: Weights = "uniform"
    # The distribution the proxy draws its data from (Algorithm 1: uniform over domains); its
    # loss is reweighted by alpha_t instead (mode `reweight`). Same forms as reference_weights.
    proxy_sampling: Weights = "uniform"
    # `reweight`: the loss is reweighted by alpha_t (the paper). `resample`: data drawn from alpha_t.
    mode: Literal["reweight", "resample"] = "reweight"
    # `exact`: alpha_t from this step's losses before any gradient (all-forward-all-backward).
    # `lagged`: the gradient uses alpha_{t-1}, which allows 1F1B; a different algorithm.
    update: Literal["exact", "lagged"] = "exact"
    # Directory of cached per-token reference losses (`doremi score`); None: online reference.
    reference_cache: PathStr | None = None
    # The online reference's forward with its linears' GEMMs in FP8 (tensorwise, dynamic scaling;
    # needs torchao, `.[fp8]`): faster on Hopper, but the reference losses change slightly (FP8
    # rounding of weights and activations), so alpha does too. Off: the reference as it trained.
    reference_fp8: bool = False
    # `doremi average`: the tuned weights are the mean of alpha_t over the proxy's steps t >= this.
    average_from_step: int = 1
    # Iterated DoReMi (`doremi pipeline`): round r+1's reference trains on round r's averaged
    # weights; stop early when no domain weight moves by more than `rounds_tolerance`. 1: one
    # reference, one proxy, as in the paper's main results.
    rounds: int = 1
    # See `rounds`.
    rounds_tolerance: float = 1e-3

    def validate(self, path: str = "mixing.doremi") -> None:
        if not 0 <= self.eta < float("inf"):
            raise ConfigError(f"{path}.eta: expected a finite value >= 0, got {self.eta}")
        if self.rounds_tolerance < 0:
            raise ConfigError(f"{path}.rounds_tolerance: expected >= 0, got {self.rounds_tolerance}")
        if not 0 <= self.smoothing <= 1:
            raise ConfigError(f"{path}.smoothing: expected a value in [0, 1], got {self.smoothing}")
        if self.mode == "resample" and self.reference_cache:
            raise ConfigError(
                f"{path}.reference_cache: a cache needs a fixed proxy data stream, but "
                f"{path}.mode 'resample' draws the data from alpha"
            )
        if self.reference_fp8 and self.reference_cache:
            raise ConfigError(
                f"{path}.reference_fp8: applies to the online reference's forward, but "
                f"{path}.reference_cache reads cached losses instead; set one of them"
            )
        if self.reference_fp8:
            require_torchao(f"{path}.reference_fp8")
        if self.rounds < 1:
            raise ConfigError(f"{path}.rounds: expected >= 1, got {self.rounds}")
        if self.average_from_step < 1:
            raise ConfigError(f"{path}.average_from_step: expected >= 1, got {self.average_from_step}")
