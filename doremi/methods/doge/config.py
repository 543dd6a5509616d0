"""The options of DoGE (`mixing.doge`); the method itself is in method.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from data.config import Weights
from trainer.config.tools import ConfigError


@dataclass
class DoGEConfig:
    """DoGE (Fan et al. 2024): domain weights from each domain's gradient alignment with a
    held-out target mixture's gradient."""

    # `authors`: the released code's update (github Olivia-fsm/DoGE, src/trainer.py): per-domain
    # gradient clipping, scores divided by the mean gradient norm and clipped into lr_t * score_clip.
    # `paper`: equation 6 as written (doremi/methods/doge/method.py says where they differ).
    variant: Literal["authors", "paper"] = "authors"
    # Bregman coefficient mu of the mirror-descent step (the authors' config/doge.json: 0.01).
    mu: float = 0.01
    # The target mixture whose held-out (validation) gradient the domains align with: `uniform`,
    # `tokens`, a weights file or values.
    target: Weights = "uniform"
    # Validation sequences drawn each step for the target gradient; None: an eighth of
    # train.global_batch_size (at least 1), which keeps the target's forward and backward within
    # an eighth of the step (experiments/notes/PERFORMANCE.md).
    target_sequences: int | None = None
    # The distribution the proxy draws its data from (the paper: uniform over domains).
    sampling: Weights = "uniform"
    # Clip the scores into lr_t * [low, high]; None: the variant's (authors: their dw_min, dw_max
    # = [0, 5]; paper: no clip).
    score_clip: list[float] | None = field(default=None)
    # Clip each domain's gradient and the target's to this L2 norm before the inner products
    # (variant authors only; their max_grad_norm); None: 5.0; 0: no clip.
    domain_grad_clip: float | None = None
    # Every domain's gradient and the target's from ONE forward and backward of the step's
    # sequences sorted by domain, the target's after them (per-group weight gradients,
    # trainer/run/group_grads.py) instead of the target's pass and one pass per domain's
    # micro-batches: the same update (equal to fp32 rounding), fewer and fuller passes (at 1B on
    # one H100: 0.784 of a plain step, the k passes 0.484; experiments/results/gpu_session15).
    # Memory: k + 1 gradient copies and the update, as the k-pass step. Dense models at tp 1 and
    # pp 1 without FP8 only. null (the default): the one pass wherever the layout allows it, the
    # k passes elsewhere; true: the one pass or a refusal; false: the k passes.
    one_pass: bool | None = None

    def validate(self, path: str = "mixing.doge") -> None:
        if self.variant not in ("authors", "paper"):
            raise ConfigError(f"{path}.variant: expected 'authors' or 'paper', got {self.variant!r}")
        if not 0 < self.mu < float("inf"):
            raise ConfigError(f"{path}.mu: expected a finite value > 0, got {self.mu}")
        if self.target_sequences is not None and self.target_sequences < 1:
            raise ConfigError(f"{path}.target_sequences: expected >= 1, got {self.target_sequences}")
        clip = self.score_clip
        if clip is not None and (len(clip) != 2 or any(math.isnan(x) for x in clip) or clip[0] > clip[1]):
            raise ConfigError(f"{path}.score_clip: expected [low, high] with low <= high, got {clip}")
        c = self.domain_grad_clip
        if c is not None and not 0 <= c < float("inf"):
            raise ConfigError(f"{path}.domain_grad_clip: expected a finite value >= 0, got {c}")
        if c and self.variant == "paper":
            raise ConfigError(f"{path}.domain_grad_clip: applies to variant 'authors' only, got {c} with 'paper'")
