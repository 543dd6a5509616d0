"""The learning rate at an optimizer step: linear warmup, then decay from `lr` to `min_lr`.

Steps are 1-based, as in the logs: step 1 is the first optimizer update, step `steps` the last.
With W warmup steps (`warmup_steps`, else round(warmup_fraction x steps)):

- warmup, 1 <= s <= W: lr x s / W (step 1 already moves the weights; step W reaches lr);
- decay, W < s <= steps: progress p = (s - W) / (steps - W) runs from 1/(steps - W) to 1 and
  the rate goes from lr to min_lr, reached exactly at the last step:
  cosine lr_min + (lr - lr_min) (1 + cos(pi p)) / 2, linear lr + (lr_min - lr) p,
  exponential lr (lr_min / lr)^p (DoReMi, Xie et al. 2023, App.: 6% warmup then 1e-3 -> 1e-4),
  constant lr.
Steps past `steps` stay at the final rate.
"""

from __future__ import annotations

import math

from trainer.config.schema import TrainConfig


def warmup_steps(cfg: TrainConfig) -> int:
    if cfg.warmup_steps is not None:
        if cfg.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps: expected >= 0, got {cfg.warmup_steps}")
        return cfg.warmup_steps
    return int(round(cfg.warmup_fraction * cfg.steps))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of 1-based optimizer step `step` (see the module docstring)."""
    if step < 1:
        raise ValueError(f"lr_at: steps are 1-based, got step {step}")
    w = warmup_steps(cfg)
    if step <= w:
        return cfg.lr * step / w
    if cfg.decay == "constant":
        return cfg.lr
    progress = min((step - w) / max(cfg.steps - w, 1), 1.0)
    if cfg.decay == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.decay == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    if cfg.decay == "exponential":
        if cfg.min_lr <= 0:
            raise ValueError(f"train.min_lr: exponential decay needs min_lr > 0, got {cfg.min_lr}")
        return cfg.lr * (cfg.min_lr / cfg.lr) ** progress
    raise ValueError(f"train.decay: expected one of cosine, linear, exponential, constant, got {cfg.decay!r}")
