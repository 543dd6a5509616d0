"""What a data-mixing method plugs into the trainer, and what the trainer supplies it
(docs/design.md section 2).

A method is given to the `Trainer` when it is built (`method=`: a factory that receives a
`MethodContext`). It declares in `Needs` which signals it reads, and the trainer supplies them
in `StepSignals`, reduced over the global batch (all data-parallel ranks, micro-batches and
pipeline stages) and identical on every rank. A method is therefore a deterministic function
of global quantities: it holds no process-group code, and its weights do not depend on the
layout. Each step t the loop calls, on every rank:

1. `sampling_weights(t)`: the domain weights this step's global batch is drawn with, as exact
   counts (the default) or, under `needs.draws == "random"`, as independent random draws
   (bandits need true draws for their importance weights; `data.sampling.sampler`).
2. `prepare_batches(t, micro_batches)`: attach per-token data (reference losses) before any
   forward.
3. `loss_weights(t, signals)`: per-domain weights w of this step's objective
   sum_i w_i * (mean loss over domain i's tokens in the global batch); None is the plain mean
   token loss. Called once per step: before the step with `signals=None`, or, under
   `needs.stats_before_backward`, after every forward with this step's signals (the schedule is
   then all-forward-all-backward; on the pipeline stages without the losses the call comes
   after the step, with the same signals, so that every rank's state stays the same).
4. Under `needs.alignment`, the step is DoGE's (`trainer.run.alignment`): one gradient per domain,
   each weighted by `alignment_weight(t, i, a_i, lr_t)` as soon as its inner product a_i with the
   target gradient is known (or, under `Alignment.deferred`, all at once by `alignment_weights`
   once every domain's gradient is kept).
5. `after_step(t, signals)` after the update, with the step's `StepSignals`; what it returns is
   merged into the step's `metrics.jsonl` row.
6. Validation losses: at every step t (t = 0 before a fresh run's first step) for which
   `validation_due(t)` holds, `observe_validation(t, losses)` with the per-domain validation
   losses (of the dev half under `data.validation_split: dev_test`: `Needs.validation_split`);
   the time they take is logged apart (`method_eval_s`).

`state_dict` / `load_state_dict` travel in every checkpoint, so a resumed run continues the
method exactly; `close` ends the run. Plain training is `FixedMixture`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from trainer.parallel.context import ParallelContext

DRAWS = ("exact", "random")


@dataclass(frozen=True)
class Alignment:
    """DoGE's target: the gradient of the mean loss on `sequences` validation sequences drawn
    each step from the mixture `weights` (random draws, reproducible from the seed and step)."""

    weights: tuple[float, ...]
    sequences: int
    #: Clip each domain's gradient and the target's to this L2 norm (of the dp-reduced gradient)
    #: before any inner product (DoGE's released code); 0: no clip.
    domain_clip: float = 0.0
    #: The weights need every domain's gradient first (DoGE's released code divides the scores by
    #: the domains' mean gradient norm): the step keeps the k domain gradients and asks
    #: `alignment_weights` once, instead of `alignment_weight` per domain.
    deferred: bool = False
    #: Every domain's gradient and the target's from ONE forward and backward of the step's
    #: sequences sorted by domain, the target's after them as group k (`trainer.run.group_grads`),
    #: instead of the target's pass and one pass per domain: k + 1 gradient copies and the update,
    #: as deferred; dense models at tp 1 and pp 1 only (the method's config refuses the rest).
    one_pass: bool = False


@dataclass(frozen=True)
class Needs:
    """The signals a method reads. The defaults are plain training's: nothing."""

    #: Number of per-token statistics (`token_stats`) whose per-domain sums over the global
    #: batch arrive in `StepSignals.stats` [m, k].
    token_stats: int = 0
    #: `loss_weights` reads this step's statistics: every forward runs before any backward.
    stats_before_backward: bool = False
    #: `exact`: each domain gets its apportioned count, remainders carried between steps.
    #: `random`: each sequence's domain drawn independently with the sampling weights.
    draws: Literal["exact", "random"] = "exact"
    #: Per-domain validation losses on the method's schedule (`validation_due`).
    validation: bool = False
    #: Validation sequences per domain of each of those passes; None: `train.eval_sequences`.
    validation_sequences: int | None = None
    #: Per-domain gradient inner products with a target gradient (DoGE).
    alignment: Alignment | None = None
    #: The validation documents the losses and the target come from: only `dev` is handed to
    #: a method (the verdict is computed on `test`; data/store/validation_split.py); any other is refused.
    validation_split: str = "dev"
    #: `after_step` reads the step's per-domain losses and tokens on the host every step
    #: (`StepSignals.on_host`): the loop starts their copy as soon as they exist, ahead of the
    #: optimizer's kernels (`StepSignals.copy_to_host`).
    host_signals: bool = False


@dataclass
class HostSignals:
    """A step's per-domain training signals on the host, float64 [k] each."""

    loss_sum: np.ndarray
    tokens: np.ndarray

    @property
    def domain_loss(self) -> np.ndarray:
        """`StepSignals.domain_loss` (the same fp64 division, so the same bits)."""
        return self.loss_sum / np.maximum(self.tokens, 1.0)


@dataclass(frozen=True)
class MethodContext:
    """What a method may know about the run it is plugged into."""

    domains: list[str]
    run_dir: Path
    #: Global rank 0: the one process that writes the method's files.
    is_main: bool
    device: torch.device
    seed: int
    steps: int
    global_batch_size: int
    seq_len: int
    #: Tokens of each domain's train split (the natural mixture).
    train_tokens: list[int]
    #: The layout, for signal providers built with the method (a reference model's forward),
    #: never for a method's own math, which sees only global quantities.
    pc: ParallelContext = field(repr=False)

    @property
    def k(self) -> int:
        return len(self.domains)


@dataclass
class StepSignals:
    """One step's global-batch signals, identical on every rank; tensors stay on the device."""

    #: The sampling weights this step was drawn with.
    weights: np.ndarray
    #: Sequences drawn per domain [k] (host).
    sequences: np.ndarray
    #: Non-masked tokens per domain [k] float64.
    tokens: torch.Tensor
    #: The model's learning rate at this step.
    lr: float = 0.0
    #: Sums of the per-token training loss per domain [k] float64 (None before the backward of
    #: a step whose weights come from its losses: use `stats` there).
    loss_sum: torch.Tensor | None = None
    #: Per-domain sums of the method's `token_stats` [m, k] float64.
    stats: torch.Tensor | None = None
    #: Per-domain inner products of each domain's mean-loss gradient with the target's [k].
    alignment: torch.Tensor | None = None
    #: Under `Alignment.deferred`: each domain's gradient norm [k] float64, after its clip.
    grad_norms: torch.Tensor | None = None

    #: `copy_to_host`'s pinned copies of loss_sum and tokens and the event after them.
    _host: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None] | None = field(default=None, repr=False)

    @property
    def domain_loss(self) -> torch.Tensor:
        """Mean training loss per domain [k] (0 where a domain is absent)."""
        assert self.loss_sum is not None
        return self.loss_sum / self.tokens.clamp_min(1)

    def copy_to_host(self) -> None:
        """Queue the copies of loss_sum and tokens to (pinned) host memory now. Queued right
        after the backward, before the optimizer's kernels, `on_host` then waits for the backward
        alone and the host prepares the next step while the optimizer runs; read with `.tolist()`
        after the update, the host waited for the whole step and the next step's first kernels
        for the host (ODM 0.976-0.984 of plain at 1B, one H100, sessions 15 and 16)."""
        assert self.loss_sum is not None
        cuda = self.loss_sum.device.type == "cuda"
        loss = torch.empty(self.loss_sum.shape, dtype=torch.float64, pin_memory=cuda)
        tokens = torch.empty(self.tokens.shape, dtype=torch.float64, pin_memory=cuda)
        loss.copy_(self.loss_sum, non_blocking=cuda)
        tokens.copy_(self.tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._host = (loss, tokens, event)

    def on_host(self) -> HostSignals:
        """loss_sum and tokens as float64 arrays, from `copy_to_host` (queued now if the loop
        did not: a method whose `needs.host_signals` is off)."""
        if self._host is None:
            self.copy_to_host()
        assert self._host is not None
        loss, tokens, event = self._host
        if event is not None:
            event.synchronize()
        return HostSignals(loss.numpy().copy(), tokens.numpy().copy())


class MixingHook(Protocol):
    needs: Needs

    def sampling_weights(self, step: int) -> np.ndarray: ...

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None: ...

    def token_stats(self, losses: torch.Tensor, batch: dict) -> list[torch.Tensor]:
        """Per-token statistics [b, s] of one micro-batch from its detached per-token losses
        (`needs.token_stats` of them; summed per domain in at least fp32, fp64 kept)."""
        ...

    def loss_weights(self, step: int, signals: StepSignals | None) -> torch.Tensor | None: ...

    def alignment_weight(self, step: int, domain: int, alignment: torch.Tensor, lr: float) -> torch.Tensor:
        """Unnormalised weight of domain `domain`'s gradient in this step's update, from its
        inner product with the target gradient (0-dim tensors on the device) and the step's
        learning rate `lr`. The update is
        sum_i m_i g_i / sum_i m_i over all domains (an absent domain's gradient is 0, and so
        is its inner product)."""
        ...

    def alignment_weights(self, step: int, alignment: torch.Tensor, norms: torch.Tensor, lr: float) -> torch.Tensor:
        """Under `Alignment.deferred`: the weights [k] of the domains' (clipped) gradients in this
        step's update sum_i w_i g_i, from every inner product and gradient norm [k] at once."""
        ...

    def validation_due(self, step: int) -> bool: ...

    def observe_validation(self, step: int, losses: torch.Tensor) -> None: ...

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        """The step's values for the trainer's metrics row. A tensor value is per domain ([k],
        on the device) and is read on the host only when the loop logs (`Trainer._row`), so that
        a step's end never waits for the device."""
        ...

    def flush(self) -> None:
        """Write what the method deferred (a per-step log held on the device): called where the
        loop reads the device anyway, at its logging steps and before a checkpoint."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


#: How a method reaches the trainer: built once the trainer knows its run.
MethodFactory = Callable[[MethodContext], MixingHook]


class MethodBase:
    """Defaults for every hook of `MixingHook` but `sampling_weights`: no signals, no state."""

    needs = Needs()

    def prepare_batches(self, step: int, micro_batches: list[dict]) -> None:
        pass

    def token_stats(self, losses: torch.Tensor, batch: dict) -> list[torch.Tensor]:
        return []

    def loss_weights(self, step: int, signals: StepSignals | None) -> torch.Tensor | None:
        return None

    def alignment_weight(self, step: int, domain: int, alignment: torch.Tensor, lr: float) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not ask for gradient alignment")

    def alignment_weights(self, step: int, alignment: torch.Tensor, norms: torch.Tensor, lr: float) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not ask for deferred gradient alignment")

    def validation_due(self, step: int) -> bool:
        return False

    def observe_validation(self, step: int, losses: torch.Tensor) -> None:
        pass

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        return {}

    def flush(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class FixedMixture(MethodBase):
    """Sample with fixed domain weights; minimise the mean per-token loss."""

    def __init__(self, weights: np.ndarray):
        self.weights = np.asarray(weights, dtype=np.float64)

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.weights
