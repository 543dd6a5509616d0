"""DoReMi: Group DRO over domains on the excess loss over a reference (Xie et al. 2023,
Algorithm 1; docs/design.md section 4).

Each step t, over the global batch (all dp ranks and micro-batches):
  lambda_t[i] = sum_{tokens of domain i} max(l_proxy - l_ref, 0) / n_i
  alpha_t     = (1 - c) softmax(log alpha_{t-1} + eta lambda_t) + c u
and the proxy descends sum_i alpha_t[i] * (mean proxy loss over domain i's tokens). In `exact`
mode alpha_t is computed from this step's forward losses before any backward (the trainer runs
all forwards first); in `lagged` mode the gradient uses alpha_{t-1} and alpha_t is computed
after the step. In `resample` mode the proxy's data is drawn from alpha_{t-1} and the loss is the
plain mean. The trainer hands every rank the same per-domain sums (trainer/run/signals.py), and the
update runs in float64, so alpha_t does not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from doremi.methods.doremi.config import DoReMiConfig
from doremi.methods.doremi.update import domain_excess, token_excess, uniform_log_weights, update_weights
from doremi.methods.log import MethodLog
from trainer.run.hooks import MethodBase, MethodContext, Needs, StepSignals


class DoReMi(MethodBase):
    """Owns alpha (as log alpha) and the last lambda; `reference_losses` attaches the
    reference's per-token losses (`ref_loss`) to the micro-batches (doremi/methods/reference.py)."""

    def __init__(
        self,
        cfg: DoReMiConfig,
        ctx: MethodContext,
        sampling_weights: np.ndarray,
        reference_losses: Callable[[int, list[dict]], None],
    ):
        self.cfg = cfg
        self.domains = ctx.domains
        self.k = ctx.k
        self.fixed_sampling = np.asarray(sampling_weights, dtype=np.float64)
        self.reference_losses = reference_losses
        exact = cfg.mode == "reweight" and cfg.update == "exact"
        # excess sums, reference loss sums
        self.needs = Needs(token_stats=2, stats_before_backward=exact)
        dev = ctx.device
        self.log_alpha = uniform_log_weights(self.k, device=dev, dtype=torch.float64)
        self.excess = torch.zeros(self.k, dtype=torch.float64, device=dev)
        self.ref_loss = torch.zeros(self.k, dtype=torch.float64, device=dev)
        self.log = MethodLog(ctx)
        self._updated = False

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    def sampling_weights(self, step: int) -> np.ndarray:
        if self.cfg.mode == "resample":
            return self.alpha.cpu().numpy()
        return self.fixed_sampling

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None:
        self._updated = False
        self.reference_losses(step, micro_batches)

    def token_stats(self, losses: torch.Tensor, batch: dict) -> list[torch.Tensor]:
        return [token_excess(losses, batch["ref_loss"]), batch["ref_loss"].double()]

    def loss_weights(self, step: int, signals: StepSignals | None) -> torch.Tensor | None:
        if self.cfg.mode == "resample":
            return None
        if signals is not None:  # exact: alpha_t from this step's losses
            self._update(signals)
        return self.alpha

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        if not self._updated:
            self._update(signals)
        alpha, excess, ref = self.alpha, self.excess, self.ref_loss
        # device tensors: read on the host at the trainer's next flush or logging step, not now
        self.log.append(
            step,
            {
                "weights": alpha,
                "excess": excess,
                "proxy_loss": signals.domain_loss,
                "ref_loss": ref,
                "tokens": signals.tokens,
            },
        )
        return {"domain_weights": alpha, "excess_loss": excess, "reference_loss": ref}

    def flush(self) -> None:
        self.log.flush()

    def _update(self, signals: StepSignals) -> None:
        """lambda_t and alpha_t from the global batch's excess sums and token counts."""
        assert signals.stats is not None
        self.excess = domain_excess(signals.stats[0], signals.tokens, self.excess)
        self.log_alpha, _ = update_weights(self.log_alpha, self.excess, self.cfg.eta, self.cfg.smoothing)
        self.ref_loss = signals.stats[1] / signals.tokens.clamp_min(1)
        self._updated = True

    def state_dict(self) -> dict[str, Any]:
        return {"log_alpha": self.log_alpha.tolist(), "excess": self.excess.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        dev = self.log_alpha.device
        self.log_alpha = torch.tensor(state["log_alpha"], dtype=torch.float64, device=dev)
        self.excess = torch.tensor(state["excess"], dtype=torch.float64, device=dev)

    def close(self) -> None:
        self.log.close()
