"""DoGE: domain reweighting with generalization estimation (Fan, Pagliardini and Jaggi 2024,
"DoGE: Domain Reweighting with Generalization Estimation", ICML; Algorithm 1), in two variants.

Each step t the proxy takes one gradient per domain, g_i = grad of the mean loss over domain
i's tokens in the global batch, and the gradient g_T of the mean loss on a target batch
(`target_sequences` validation sequences of the `target` mixture). With the model's learning
rate lr_t and the Bregman coefficient mu (mirror descent on the simplex, the paper's eq. 6):

`variant: paper` (equation 6 as written)

    W_t[i]     = <g_i, g_T>
    alpha_t    = softmax(log alpha_{t-1} + lr_t W_t / mu)
    direction  = sum_i alpha_t[i] g_i

The trainer (`trainer/run/alignment.py`) streams the domains: it hands each W_t[i] to
`alignment_weight`, which returns alpha_{t-1}[i] exp(lr_t W_t[i] / mu), and divides the weighted
sum by the sum of those weights; so the update uses alpha_t exactly with one extra gradient
buffer besides the target. `score_clip`, when set, clips lr_t W_t into lr_t [low, high].

`variant: authors` (the default; github Olivia-fsm/DoGE at commit 88400e9, `src/trainer.py`,
`update_domain_weights_distributed`, lines 719-769, the path `config/doge.json` runs, with its
`compute_pertoken_losses: false`), in their order:

    g_i <- c_i g_i,  g_T <- c_T g_T,  c = min(1, C / (||g|| + 1e-6))     (lines 733-734, C = 5)
    W_t[i]   = <g_i, g_T>                                                 (lines 746-756)
    N_t      = mean_i ||g_i||                     (the clipped norms; line 758)
    s_t[i]   = clip(lr_t W_t[i] / (N_t + 1e-6), lr_t low, lr_t high)     (lines 759-760, [0, 5])
    alpha_t  = softmax(log alpha_{t-1} + s_t / mu)                        (lines 763-764)
    direction = sum_i alpha_t[i] g_i              (the clipped g_i, line 769; not renormalised)

with mu = 0.01 (`config/doge.json`; their trainer's own default, line 160, is 0.05), C = 5 (their
`max_grad_norm`), [low, high] = [dw_min, dw_max] = [0, 5]: a domain whose gradient opposes the
target's gets score 0, never a negative one. N_t and the clip need every domain's gradient
before any is weighted, so the trainer keeps the k clipped domain gradients (k gradient copies
besides the target; under dp each is summed over dp first, k all-reduces instead of one) and
asks `alignment_weights` once (`Alignment.deferred`). The step then clips the combined
gradient by `train.grad_clip` as theirs does by the same `max_grad_norm` (the HF trainer's
loop). The output, in both variants, is the mean of alpha_t over the steps (their `avg_dw`).

Differences from the released code that remain, in both variants:
- Their target is a `mix` domain of the training batch: an equal share of each domain's
  training split held out from the domains' own data (`src/data/utils.py`, `slim_full-mix`),
  drawn as an eighth of every batch (8 uniformly sampled sources, `src/dataloader.py`); here it
  is `target_sequences` (an eighth of the batch by default) validation (dev) sequences of the
  `target` mixture, drawn on top of the training batch, so no training sequence is spent on it.
- A domain absent from the batch keeps, in theirs, the gradient it had when last present (a
  stale row of `flat_grad_mat`, line 737; a zero row before its first appearance) in its
  score and in N_t; here its gradient is 0: its score is 0 and it adds 0 to the mean norm.
- Their branch that drops a domain's product with itself when the target domains are the
  training domains (line 753) compares sets of 0-dim tensors, which hash by identity, so it
  never runs; with the `mix` target it would not apply anyway. Not reproduced.
- `reweight_eps` (mixing alpha with uniform, 0 in their config) is not offered.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from doremi.methods.doge.config import DoGEConfig
from doremi.methods.log import MethodLog
from trainer.run.hooks import Alignment, MethodBase, MethodContext, Needs, StepSignals

#: The released code's defaults (config/doge.json): dw_min, dw_max and max_grad_norm.
AUTHORS_SCORE_CLIP = [0.0, 5.0]
AUTHORS_DOMAIN_CLIP = 5.0


def score_clip(cfg: DoGEConfig) -> list[float] | None:
    """The clip of lr_t-scaled scores a run applies: `score_clip`, else the variant's."""
    if cfg.score_clip is not None:
        return list(cfg.score_clip)
    return list(AUTHORS_SCORE_CLIP) if cfg.variant == "authors" else None


def domain_clip(cfg: DoGEConfig) -> float:
    """The per-domain gradient clip a run applies (0: none)."""
    if cfg.variant != "authors":
        return 0.0
    return AUTHORS_DOMAIN_CLIP if cfg.domain_grad_clip is None else float(cfg.domain_grad_clip)


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


def authors_scores(
    alignment: torch.Tensor, norms: torch.Tensor, lr: float, mu: float, clip: list[float] | None
) -> torch.Tensor:
    """s_t / mu of the released code (src/trainer.py lines 756-763): lr_t W_t divided by the mean
    of the domains' (clipped) gradient norms plus 1e-6, clipped into lr_t [low, high]."""
    scores = lr * alignment
    scores = scores / (norms.mean() + 1e-6)
    if clip is not None:
        scores = scores.clamp(lr * clip[0], lr * clip[1])
    return scores / mu


def doge_update(log_alpha: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """log alpha_t = log softmax(log alpha_{t-1} + scores) (mirror descent on the simplex)."""
    return torch.log_softmax(log_alpha + scores, dim=0)


class DoGE(MethodBase):
    def __init__(
        self,
        cfg: DoGEConfig,
        ctx: MethodContext,
        sampling: np.ndarray,
        target: np.ndarray,
        target_batch: int,
        one_pass: bool,
    ):
        """`target_batch`: validation sequences of the target gradient per step (`target_sequences`);
        `one_pass`: the step's form as the layout resolved it (`doremi.methods.doge.one_pass`)."""
        self.cfg = cfg
        self.domains = ctx.domains
        self.sampling = np.asarray(sampling, dtype=np.float64)
        self.clip = score_clip(cfg)
        self.authors = cfg.variant == "authors"
        spec = Alignment(
            tuple(float(x) for x in target),
            target_batch,
            domain_clip(cfg),
            deferred=self.authors,
            one_pass=one_pass,
        )
        self.needs = Needs(alignment=spec)
        self.log_alpha = torch.full((ctx.k,), -float(np.log(ctx.k)), dtype=torch.float64, device=ctx.device)
        self.log = MethodLog(ctx)

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.sampling

    def alignment_weight(self, step: int, domain: int, alignment: torch.Tensor, lr: float) -> torch.Tensor:
        """alpha_{t-1}[i] exp(lr_t W_t[i] / mu): the weight of g_i before normalisation (paper)."""
        score = doge_scores(alignment.to(torch.float64), lr, self.cfg.mu, self.clip)
        return torch.exp(self.log_alpha[domain] + score)

    def alignment_weights(self, step: int, alignment: torch.Tensor, norms: torch.Tensor, lr: float) -> torch.Tensor:
        """alpha_t, the weights of the clipped g_i (authors: they need N_t, every domain's norm)."""
        return doge_update(self.log_alpha, self._scores(alignment, norms, lr)).exp()

    def _scores(self, alignment: torch.Tensor, norms: torch.Tensor | None, lr: float) -> torch.Tensor:
        if self.authors:
            assert norms is not None
            return authors_scores(alignment.to(torch.float64), norms.to(torch.float64), lr, self.cfg.mu, self.clip)
        return doge_scores(alignment, lr, self.cfg.mu, self.clip)

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        assert signals.alignment is not None
        self.log_alpha = doge_update(self.log_alpha, self._scores(signals.alignment, signals.grad_norms, signals.lr))
        alpha = self.alpha
        row = {"weights": alpha, "tokens": signals.tokens, "loss": signals.domain_loss, "alignment": signals.alignment}
        if signals.grad_norms is not None:
            row["grad_norm"] = signals.grad_norms
        self.log.append(step, row)  # read on the host at the trainer's next flush, not now
        return {"domain_weights": alpha}

    def flush(self) -> None:
        self.log.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"log_alpha": self.log_alpha.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.log_alpha = torch.tensor(state["log_alpha"], dtype=torch.float64, device=self.log_alpha.device)

    def close(self) -> None:
        self.log.close()
