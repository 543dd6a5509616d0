"""Continuing a finished run to more steps: the learning rate of the added steps.

`lr_at` stretches its warmup and decay over `train.steps`, so resuming a finished cosine run with
more steps would restart it high on a new, longer curve (1e-4 at the end, 6.4e-4 at the next
step). `train.extend` says what the user wants instead; the choice and the step it was made at
travel in the checkpoint, so that an interrupted extension resumes on the same curve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.config.schema import TrainConfig
from trainer.config.tools import ConfigError
from trainer.optim.lr_schedule import lr_at
from trainer.records.run_dir import schedule_depends_on_steps


@dataclass(frozen=True)
class Extension:
    """Steps after `from_step` (the finished run's train.steps) follow `mode`."""

    mode: str  # continue_at_min_lr | restart_schedule
    from_step: int

    def lr(self, step: int, train: TrainConfig) -> float:
        old = dataclasses.replace(train, steps=self.from_step)
        if step <= self.from_step:
            return lr_at(step, old)
        if self.mode == "continue_at_min_lr":
            return lr_at(self.from_step, old)
        return lr_at(step - self.from_step, dataclasses.replace(train, steps=train.steps - self.from_step))

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "from_step": self.from_step}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Extension | None:
        return None if not state else cls(str(state["mode"]), int(state["from_step"]))


def scheduled_lr(step: int, train: TrainConfig, extension: Extension | None) -> float:
    """The rate of `step`: `lr_at`, or the extension's for a run continued past its end."""
    return lr_at(step, train) if extension is None else extension.lr(step, train)


def plan_extension(
    run_dir: Any, saved_step: int, saved_steps: int, train: TrainConfig, current: Extension | None
) -> Extension | None:
    """The extension a resume from `saved_step` (of a run configured for `saved_steps`) trains
    under: the checkpoint's own (`current`) unless this resume extends a finished run to more
    steps, which `train.extend: refuse` stops with one line."""
    if not (saved_step == saved_steps < train.steps and schedule_depends_on_steps(train)):
        return current
    if train.extend == "refuse":
        before = scheduled_lr(saved_step, dataclasses.replace(train, steps=saved_steps), current)
        after = lr_at(saved_step + 1, train)
        raise ConfigError(
            f"{run_dir}: the run finished at step {saved_step}; continuing to train.steps={train.steps} "
            f"would re-stretch the learning-rate schedule (lr {before:.3g} at step {saved_step}, "
            f"{after:.3g} at step {saved_step + 1}); set train.extend: continue_at_min_lr or "
            f"restart_schedule, or use another run directory"
        )
    return Extension(train.extend, saved_steps)
