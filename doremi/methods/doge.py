"""DoGE: domain reweighting with generalization estimation (Fan, Pagliardini and Jaggi 2024,
"DoGE: Domain Reweighting with Generalization Estimation", ICML; Algorithm 1).

Each step t the proxy takes one gradient per domain, g_i = grad of the mean loss over domain
i's tokens in the global batch, and the gradient g_T of the mean loss on a held-out target batch
(validation sequences of the target mixture). With the model's learning rate lr_t and the
Bregman coefficient mu (mirror descent on the simplex, the paper's equation 6):

    W_t[i]     = <g_i, g_T>
    alpha_t    = softmax(log alpha_{t-1} + lr_t W_t / mu)
    theta_t+1  = theta_t - lr_t-step with the direction sum_i alpha_t[i] g_i

and the output is the mean of alpha_t over the steps (the authors' `avg_dw`). The trainer
(`trainer/alignment.py`) streams the domains: it hands each W_t[i] to `alignment_weight`, which
returns alpha_{t-1}[i] exp(lr_t W_t[i] / mu), and divides the weighted sum by the sum of those
weights; so the update uses alpha_t exactly with one extra gradient buffer besides the target.
A domain absent from the batch has g_i = 0, so W_t[i] = 0 and its weight moves only through the
normalisation.

The authors' code (github Olivia-fsm/DoGE, `src/trainer.py`) differs in ways that are options
or stated limits here:
- `score_clip`: it clips lr_t W_t[i] into lr_t [dw_min, dw_max] (their defaults 0 and 5).
- It takes the target gradient from the training batch itself when the target is the training
  mixture, dropping each domain's product with itself; here the target is always held out.
- It divides the scores by the mean gradient norm of the domains and can mix alpha with the
  uniform distribution (`reweight_eps`, 0 by default): both need every domain's gradient before
  any is weighted (k gradient copies), so they are not offered.
- It clips each domain's gradient norm before the products (`max_grad_norm`); here the step's
  usual clipping applies to the combined gradient.
- Its W_t[i] is the sum of g_i's products with each target domain's own gradient (the paper's
  sum over j of <g_i, g_j>); here g_T is the gradient of the mean loss over the target batch, so
  for a target spread evenly over m domains W_t is about 1/m of theirs, and the same step
  corresponds to mu / m here (the defaults' mu = 0.05 is theirs, on their norm-divided scores).
- A domain absent from the batch keeps the gradient it had when last present in its score
  (a stale row of its `flat_grad_mat`); here its score is 0. Both leave it out of the combined
  gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from data.config import Weights
from doremi.methods.log import MethodLog
from trainer.configtools import ConfigError
from trainer.hooks import Alignment, MethodBase, MethodContext, Needs, StepSignals


@dataclass
class DoGEConfig:
    """DoGE (Fan et al. 2024): domain weights from each domain's gradient alignment with a
    held-out target mixture's gradient."""

    # Bregman coefficient mu of the mirror-descent step (the authors' default 0.05).
    mu: float = 0.05
    # The target mixture whose held-out (validation) gradient the domains align with: `uniform`,
    # `tokens`, a weights file or values.
    target: Weights = "uniform"
    # Validation sequences drawn each step for the target gradient; None: an eighth of
    # train.global_batch_size (at least 1), which keeps the target's forward and backward within
    # an eighth of the step (experiments/notes/PERFORMANCE.md).
    target_sequences: int | None = None
    # The distribution the proxy draws its data from (the paper: uniform over domains).
    sampling: Weights = "uniform"
    # The authors' variant: clip lr_t * W_t[i] into lr_t * [low, high] (their code: [0, 5]); None
    # (the paper) does not clip.
    score_clip: list[float] | None = field(default=None)

    def validate(self, path: str = "mixing.doge") -> None:
        if not 0 < self.mu < float("inf"):
            raise ConfigError(f"{path}.mu: expected a finite value > 0, got {self.mu}")
        if self.target_sequences is not None and self.target_sequences < 1:
            raise ConfigError(f"{path}.target_sequences: expected >= 1, got {self.target_sequences}")
        clip = self.score_clip
        if clip is not None and (len(clip) != 2 or any(math.isnan(x) for x in clip) or clip[0] > clip[1]):
            raise ConfigError(f"{path}.score_clip: expected [low, high] with low <= high, got {clip}")


def target_sequences(cfg: DoGEConfig, global_batch_size: int) -> int:
    """The target batch of a run: `cfg.target_sequences`, or an eighth of the global batch (at
    least one sequence). A property of the run, never of its layout."""
    if cfg.target_sequences is not None:
        return cfg.target_sequences
    return max(1, global_batch_size // 8)


def doge_scores(alignment: torch.Tensor, lr: float, mu: float, clip: list[float] | None = None) -> torch.Tensor:
    """lr_t W_t / mu (equation 6's exponent), with the authors' optional clip of lr_t W_t."""
    scores = lr * alignment
    if clip is not None:
        scores = scores.clamp(lr * clip[0], lr * clip[1])
    return scores / mu


def doge_update(log_alpha: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """log alpha_t = log softmax(log alpha_{t-1} + scores) (mirror descent on the simplex)."""
    return torch.log_softmax(log_alpha + scores, dim=0)


class DoGE(MethodBase):
    def __init__(
        self, cfg: DoGEConfig, ctx: MethodContext, sampling: np.ndarray, target: np.ndarray, target_batch: int
    ):
        """`target_batch`: validation sequences of the target gradient per step (`target_sequences`)."""
        self.cfg = cfg
        self.domains = ctx.domains
        self.sampling = np.asarray(sampling, dtype=np.float64)
        self.needs = Needs(alignment=Alignment(tuple(float(x) for x in target), target_batch))
        self.log_alpha = torch.full((ctx.k,), -float(np.log(ctx.k)), dtype=torch.float64, device=ctx.device)
        self.log = MethodLog(ctx)

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.sampling

    def alignment_weight(self, step: int, domain: int, alignment: torch.Tensor, lr: float) -> torch.Tensor:
        """alpha_{t-1}[i] exp(lr_t W_t[i] / mu): the weight of g_i before normalisation."""
        score = doge_scores(alignment.to(torch.float64), lr, self.cfg.mu, self.cfg.score_clip)
        return torch.exp(self.log_alpha[domain] + score)

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        assert signals.alignment is not None
        scores = doge_scores(signals.alignment, signals.lr, self.cfg.mu, self.cfg.score_clip)
        self.log_alpha = doge_update(self.log_alpha, scores)
        alpha = self.alpha.tolist()
        self.log.append(
            step,
            {
                "weights": alpha,
                "tokens": signals.tokens.tolist(),
                "loss": signals.domain_loss.tolist(),
                "alignment": signals.alignment.tolist(),
            },
        )
        return {"domain_weights": dict(zip(self.domains, alpha))}

    def state_dict(self) -> dict[str, Any]:
        return {"log_alpha": self.log_alpha.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.log_alpha = torch.tensor(state["log_alpha"], dtype=torch.float64, device=self.log_alpha.device)

    def close(self) -> None:
        self.log.close()
