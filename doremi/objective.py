"""DoReMi as a trainer hook: Group DRO over domains on the excess loss over a reference
(Xie et al. 2023, Algorithm 1; docs/design.md section 4).

Each step t, over the global batch (all dp ranks and micro-batches):
  lambda_t[i] = sum_{tokens of domain i} max(l_proxy - l_ref, 0) / n_i
  alpha_t     = (1 - c) softmax(log alpha_{t-1} + eta lambda_t) + c u
and the proxy descends sum_i alpha_t[i] * (mean proxy loss over domain i's tokens), i.e. token
weight alpha_t[d] / n_d. In `exact` mode alpha_t is computed from this step's forward losses
before any backward (the schedule runs all forwards first); in `lagged` mode the gradient uses
alpha_{t-1} and alpha_t is computed after the step. In `resample` mode the proxy's data is drawn
from alpha_{t-1} and the loss is the plain mean. All the math runs in float64 on every rank with
identical inputs, so alpha_t does not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data.batch import IGNORE_INDEX
from doremi.config import DoReMiConfig
from doremi.history import WeightHistory
from doremi.update import domain_excess, domain_excess_sums, uniform_log_weights, update_weights
from trainer.domains import domain_sums
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import broadcast_from_last_stage
from trainer.step import StepStats
from trainer.weighting import LossWeighting, MeanTokenLoss


class _ExactWeighting:
    """Weights alpha_t[d] / n_d, alpha_t computed in `prepare` from this step's losses."""

    needs_forward_losses = True

    def __init__(self, hook: DoReMiHook, domain_tokens: torch.Tensor):
        self.hook = hook
        self.domain_tokens = domain_tokens

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        self.hook._update(losses, batches)

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        return self.hook._token_weights(batch, self.domain_tokens)


class _LaggedWeighting(_ExactWeighting):
    """Weights alpha_{t-1}[d] / n_d, known before the step (1F1B allowed)."""

    needs_forward_losses = False

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        pass


class DoReMiHook:
    """Owns alpha (as log alpha), the last lambda, and the per-step weight history."""

    def __init__(
        self,
        cfg: DoReMiConfig,
        domains: list[str],
        pc: ParallelContext,
        run_dir: str | Path,
        sampling_weights: np.ndarray,
        reference_losses: Callable[[int, list[dict]], None],
    ):
        self.cfg = cfg
        self.domains = domains
        self.k = len(domains)
        self.pc = pc
        self.run_dir = Path(run_dir)
        self.fixed_sampling = np.asarray(sampling_weights, dtype=np.float64)
        self.reference_losses = reference_losses
        dev = pc.device
        self.log_alpha = uniform_log_weights(self.k, device=dev, dtype=torch.float64)
        self.excess = torch.zeros(self.k, dtype=torch.float64, device=dev)
        self.ref_sums = torch.zeros(2, self.k, dtype=torch.float64, device=dev)
        self._updated_this_step = False
        self._batches: list[dict] = []
        self._history: WeightHistory | None = None

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    # -- MixingHook ------------------------------------------------------------------------
    def sampling_weights(self, step: int) -> np.ndarray:
        if self.cfg.mode == "resample":
            return self.alpha.cpu().numpy()
        return self.fixed_sampling

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None:
        self._updated_this_step = False
        self._batches = micro_batches
        self.reference_losses(step, micro_batches)

    def weighting(self, step: int, micro_batches: list[dict], domain_tokens: torch.Tensor) -> LossWeighting:
        if self.cfg.mode == "resample":
            return MeanTokenLoss(domain_tokens.sum())
        if self.cfg.update == "exact":
            return _ExactWeighting(self, domain_tokens)
        return _LaggedWeighting(self, domain_tokens)

    def after_step(self, step: int, stats: StepStats) -> dict[str, Any]:
        pc = self.pc
        if pc.is_last_stage and not self._updated_this_step:
            self._update(stats.local_losses, self._batches)
        state = torch.cat([self.log_alpha[None], self.excess[None], self.ref_sums])
        state = broadcast_from_last_stage(state, pc)
        self.log_alpha, self.excess, self.ref_sums = state[0].clone(), state[1].clone(), state[2:].clone()
        alpha = self.alpha.tolist()
        if pc.is_main:
            proxy_loss = stats.domain_loss.tolist()
            ref_loss = (self.ref_sums[0] / self.ref_sums[1].clamp_min(1)).tolist()
            self.history(step).append(
                {
                    "step": step,
                    "domains": self.domains,
                    "weights": alpha,
                    "excess": self.excess.tolist(),
                    "proxy_loss": proxy_loss,
                    "ref_loss": ref_loss,
                    "tokens": stats.domain_tokens.tolist(),
                }
            )
        return {"domain_weights": dict(zip(self.domains, alpha))}

    def state_dict(self) -> dict[str, Any]:
        return {"log_alpha": self.log_alpha.tolist(), "excess": self.excess.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        dev = self.pc.device
        self.log_alpha = torch.tensor(state["log_alpha"], dtype=torch.float64, device=dev)
        self.excess = torch.tensor(state["excess"], dtype=torch.float64, device=dev)

    def history(self, step: int) -> WeightHistory:
        """Opened at the first step this process runs: lines of steps >= it (left by an
        interrupted run) are dropped, so a resumed run's history equals an uninterrupted one."""
        if self._history is None:
            self._history = WeightHistory(self.run_dir, resume_step=step - 1)
        return self._history

    def close(self) -> None:
        if self._history is not None:
            self._history.close()

    # -- the update (last pipeline stage) ---------------------------------------------------
    def _token_weights(self, batch: dict, domain_tokens: torch.Tensor) -> torch.Tensor:
        per_domain = self.alpha / domain_tokens.clamp_min(1)
        mask = batch["labels"] != IGNORE_INDEX
        return mask.to(torch.float32) * per_domain[batch["domain_ids"]].to(torch.float32)[:, None]

    def _update(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        """lambda_t and alpha_t from the global batch's per-token proxy and reference losses."""
        sums = torch.zeros(3, self.k, dtype=torch.float64, device=self.pc.device)  # excess, tokens, ref loss
        for loss, b in zip(losses, batches):
            mask = b["labels"] != IGNORE_INDEX
            ex, cnt = domain_excess_sums(loss.detach(), b["ref_loss"], b["domain_ids"], mask, self.k)
            sums[0] += ex.to(torch.float64)
            sums[1] += cnt.to(torch.float64)
            sums[2] += domain_sums(b["ref_loss"].double(), b["domain_ids"], mask, self.k)[0]
        if self.pc.dp > 1:
            dist.all_reduce(sums, group=self.pc.dp_group)
        self.excess = domain_excess(sums[0], sums[1], self.excess)
        self.log_alpha, _ = update_weights(self.log_alpha, self.excess, self.cfg.eta, self.cfg.smoothing)
        # Not sums[[2, 1]]: a list index is a host-to-device copy, a sync inside the step.
        self.ref_sums = torch.stack([sums[2], sums[1]])
        self._updated_this_step = True
