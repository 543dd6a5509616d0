"""One chunk of models trained together: `trainer.run.loop.Trainer.train_step`'s order for M runs.

Per step t: draw each run's global batch (`trainer.stacked.feed`), count each run's tokens N_m,
forward and backward every micro-batch with weight 1 / N_m on model m's non-masked tokens (the
ordinary mean token loss, `trainer.feed.weighting.MeanTokenLoss`: gradients summed over
micro-batches, the normalisation in the weights, which the forward takes, so that the head makes
its gradient there: `trainer.stacked.head`), clip each model by its own global norm, one
AdamW step for all at the shared `trainer.run.schedule_extension.scheduled_lr(t)`. The models are
independent in the summed objective, so model m's gradient is its run's gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from data.progress import Countdown
from data.store.batch import IGNORE_INDEX
from trainer.config.schema import TrainerConfig
from trainer.run.schedule_extension import scheduled_lr
from trainer.stacked.evaluate import evaluate_stacked
from trainer.stacked.feed import StackedFeed, token_counts
from trainer.stacked.model import StackedLlama, stack_llamas
from trainer.stacked.optim import clip_per_model, stacked_adamw


@dataclass
class ChunkResult:
    """What one chunk of models produced (host arrays)."""

    losses: np.ndarray  # [M, steps]
    grad_norms: np.ndarray  # [M, steps]
    evals: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (step, [M, k])
    params: list[dict[str, torch.Tensor]] | None = None  # per model, on the CPU


class StackedRun:
    """Models `seeds` trained on `feed`'s mixtures under `cfg` (tp = pp = dp = 1, checked by
    the caller); `autocast` is the run's compute context (`trainer.build.RunFacts.autocast`)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        feed: StackedFeed,
        seeds: Sequence[int],
        device: torch.device,
        autocast: contextlib.AbstractContextManager,
    ):
        self.cfg, self.feed, self.autocast = cfg, feed, autocast
        self.model: StackedLlama = stack_llamas(cfg.model, seeds, device, cfg.parallelism.recompute)
        self.params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = stacked_adamw(list(self.model.named_parameters()), cfg.train)
        self.step = 0

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of every model: (mean token loss [M], grad norm before clipping [M]), fp64
        and fp32 device tensors."""
        self.step += 1
        step = self.step
        batches = self.feed.step_batches(step)
        scale = 1.0 / token_counts(batches).clamp_min(1).to(self.model.rope_cos.device)
        loss_sum = torch.zeros(self.feed.models, dtype=torch.float64, device=scale.device)
        tokens = torch.zeros_like(loss_sum)
        for b in batches:
            mask = b["labels"] != IGNORE_INDEX
            with self.autocast:
                objective, losses = self.model(b, mask.to(torch.float32) * scale.view(-1, 1, 1))
            objective.backward()
            loss_sum += torch.where(mask, losses.double(), 0.0).sum(dim=(1, 2))
            tokens += mask.sum(dim=(1, 2))
        norms = clip_per_model(self.params, self.cfg.train.grad_clip)
        lr = scheduled_lr(step, self.cfg.train, None)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / tokens.clamp_min(1), norms

    def evaluate(self, validation: list[list[dict]]) -> np.ndarray:
        return evaluate_stacked(self.model, validation, self.autocast).cpu().numpy()

    def fit(
        self,
        steps: int,
        eval_every: int,
        validation: list[list[dict]] | None,
        keep_params: bool,
        countdown: Countdown | None = None,
    ) -> ChunkResult:
        """`steps` steps; validation losses at every `eval_every`-th step (0: none between) and
        at the last step when `validation` is given. `countdown`: told each step done (a
        throttled line on stderr: a chunk of a sweep trains for minutes)."""
        losses, norms, evals = [], [], []
        while self.step < steps:
            loss, norm = self.train_step()
            losses.append(loss)
            norms.append(norm)
            if countdown is not None:
                countdown.done(self.step)
            due = eval_every and self.step % eval_every == 0
            if validation is not None and (due or self.step == steps):
                evals.append((self.step, self.evaluate(validation)))
        params = None
        if keep_params:
            params = [{n: t.cpu() for n, t in self.model.unstack(m).items()} for m in range(self.model.models)]
        return ChunkResult(
            losses=torch.stack(losses, dim=1).cpu().numpy(),
            grad_norms=torch.stack(norms, dim=1).float().cpu().numpy(),
            evals=evals,
            params=params,
        )
