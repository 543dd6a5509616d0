"""Pipeline schedules: 1F1B and all-forward-all-backward over the local micro-batches.

Each rank runs its own stage (`stage(hidden_or_None, batch)`); activations and gradients move
between neighbouring stages through `trainer.parallel.p2p`. The last stage turns per-token
losses into the micro-batch objective `(weighting.token_weights(i, batch) * losses).sum()`;
gradients accumulate (sum) over micro-batches in `.grad`.

- 1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron's non-interleaved schedule): stage p
  runs pp - p - 1 warm-up forwards, then alternates one forward and one backward, then drains.
  Stage p holds at most pp - p micro-batches in flight.
- afab (GPipe order): every forward, then `weighting.prepare` on the last stage, then every
  backward. Required when the weights depend on the whole step's losses (DoReMi, Algorithm 1).

Once an output has been sent to the next stage, its storage is released (Megatron's
`deallocate_output_tensor`): backward needs only its autograd node and the received gradient.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.parallel import p2p
from trainer.parallel.context import ParallelContext

SCHEDULES = ("1f1b", "afab")


class LossWeighting(Protocol):
    """How the last stage weighs per-token losses (implementations: `trainer.feed.weighting`)."""

    #: True when the weights depend on the forward losses of the whole step (all micro-batches,
    #: all dp ranks): the schedule must then run every forward before any backward and call
    #: `prepare` in between. False: weights are known before the step starts (1F1B allowed).
    needs_forward_losses: bool

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        """Last pipeline stage only, after all forwards: per-token losses [b, s] of each local
        micro-batch (detached). May run collectives over the dp group."""

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        """Weights [b, s] for local micro-batch `index` (last pipeline stage)."""


def check_schedule(
    num_micro_batches: int, pc: ParallelContext, schedule: str, weighting: LossWeighting, few_ok: bool = False
) -> None:
    """Raise a one-line ValueError for a schedule that cannot run as asked. `few_ok`: fewer
    micro-batches than stages are allowed (a part of a step, such as one domain's sequences)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if num_micro_batches < max(pc.pp, 1) and not few_ok:
        raise ValueError(
            f"train.micro_batches: pipeline parallel with pp={pc.pp} needs at least {pc.pp} "
            f"micro-batches per step, got {num_micro_batches}"
        )
    if schedule == "1f1b" and weighting.needs_forward_losses:
        raise ValueError(
            "parallelism.pp_schedule: the loss weighting needs every forward loss before any "
            "backward (e.g. DoReMi with current-step weights); expected 'afab', got '1f1b'"
        )


@dataclass
class _Steps:
    """Forward and backward of one local micro-batch on this rank's stage."""

    stage: torch.nn.Module
    micro_batches: list[dict]
    pc: ParallelContext
    weighting: LossWeighting | None = None
    losses: list[torch.Tensor] = field(default_factory=list)

    def shape(self, i: int) -> tuple[int, ...]:
        b, s = self.micro_batches[i]["input_ids"].shape[:2]
        return tuple(self.stage.activation_shape(b, s))

    @property
    def dtype(self) -> torch.dtype:
        return self.stage.activation_dtype

    def recv_input(self, i: int) -> torch.Tensor | None:
        return _as_input(p2p.recv_forward(self.shape(i), self.dtype, self.pc))

    def forward(self, i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        out = self.stage(hidden, self.micro_batches[i])
        if self.pc.is_last_stage:
            self.losses.append(out.detach())
        elif tuple(out.shape) != self.shape(i) or out.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline: stage {self.pc.pp_rank} returned {tuple(out.shape)} {out.dtype}, "
                f"expected activation_shape {self.shape(i)} {self.dtype}"
            )
        return out

    def backward(
        self, i: int, hidden: torch.Tensor | None, out: torch.Tensor, out_grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Backward of micro-batch i; returns the gradient of the stage input (None on stage 0)."""
        if self.pc.is_last_stage:
            (self.weighting.token_weights(i, self.micro_batches[i]) * out).sum().backward()
        else:
            _backward_released(out, out_grad)
        return None if hidden is None else hidden.grad


def _as_input(received: torch.Tensor | None) -> torch.Tensor | None:
    return None if received is None else received.requires_grad_()


def _release(out: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Free an output's storage once the next stage has it; its autograd node stays.

    Skipped for views (their storage belongs to another tensor) and on the last stage (the
    losses are still needed). Safe when the output is saved for backward by the op that made it
    (autograd keeps its own reference to the storage); a stage must not feed its output into
    further ops of its own graph."""
    if not pc.is_last_stage and out._base is None and out.grad_fn is not None:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
    return out


def _backward_released(out: torch.Tensor, grad: torch.Tensor) -> None:
    """`torch.autograd.backward(out, grad)` without the shape check, which a released output
    (a 1-element placeholder) would fail; the engine only needs the graph edge."""
    torch.autograd.Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


def train_schedule(
    stage: torch.nn.Module,
    micro_batches: list[dict],
    pc: ParallelContext,
    schedule: str,
    weighting: LossWeighting,
    few_ok: bool = False,
) -> list[torch.Tensor]:
    """Forwards and backwards of all local micro-batches; gradients summed into `.grad`.

    Returns the detached per-token losses [b, s] of each micro-batch on the last stage, []
    elsewhere. With pp == 1, 1F1B is forward + backward per micro-batch."""
    check_schedule(len(micro_batches), pc, schedule, weighting, few_ok)
    steps = _Steps(stage, micro_batches, pc, weighting)
    if schedule == "afab":
        _all_forward_all_backward(steps)
    else:
        _one_forward_one_backward(steps)
    return steps.losses


def _one_forward_one_backward(steps: _Steps) -> None:
    """1F1B in three phases. Micro-batch i's first backward can only start once its forward has
    passed every later stage, so stage p runs ahead by the pp - p - 1 forwards that fill the
    stages after it; from then on it keeps that many in flight, and drains them at the end."""
    pc, n = steps.pc, len(steps.micro_batches)
    warmup = min(pc.pp - pc.pp_rank - 1, n)
    # (micro-batch index, stage input, released stage output) of forwards awaiting their backward
    in_flight: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()

    # Warm-up: forwards only, one for each later stage, so that the pipeline is full when this
    # stage's first backward arrives. The last stage (warmup = 0) skips it; stage 0 does the most.
    for i in range(warmup):
        hidden = steps.recv_input(i)
        out = steps.forward(i, hidden)
        p2p.send_forward(out, pc)
        in_flight.append((i, hidden, _release(out, pc)))

    # Steady state: for each remaining micro-batch, one forward then one backward, of the oldest
    # micro-batch in flight, so this stage never holds more than warmup + 1. Each exchange with
    # a neighbour posts its send and its receive together (output out and gradient back; input
    # gradient out and next input in): neighbours that both send first would deadlock (`p2p`).
    hidden = steps.recv_input(warmup) if warmup < n else None
    for i in range(warmup, n):
        out = steps.forward(i, hidden)
        oldest = in_flight[0][0] if in_flight else i
        grad = p2p.send_forward_recv_backward(out, steps.shape(oldest), steps.dtype, pc)
        in_flight.append((i, hidden, _release(out, pc)))
        j, hidden_j, out_j = in_flight.popleft()
        in_grad = steps.backward(j, hidden_j, out_j, grad)
        if i == n - 1:
            p2p.send_backward(in_grad, pc)  # no next input to receive: the forwards are done
        else:
            hidden = _as_input(p2p.send_backward_recv_forward(in_grad, steps.shape(i + 1), steps.dtype, pc))

    # Cool-down: the warm-up's micro-batches are still in flight; their gradients come back
    # from the next stage one by one, oldest first, and their backwards drain the pipeline.
    while in_flight:
        j, hidden_j, out_j = in_flight.popleft()
        grad = p2p.recv_backward(steps.shape(j), steps.dtype, pc)
        p2p.send_backward(steps.backward(j, hidden_j, out_j, grad), pc)


def _all_forward_all_backward(steps: _Steps) -> None:
    pc, n = steps.pc, len(steps.micro_batches)
    in_flight: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()
    for i in range(n):
        hidden = steps.recv_input(i)
        out = steps.forward(i, hidden)
        p2p.send_forward(out, pc)
        in_flight.append((hidden, _release(out, pc)))
    if pc.is_last_stage and steps.weighting.needs_forward_losses:
        steps.weighting.prepare(list(steps.losses), steps.micro_batches)
    for i in range(n):
        hidden, out = in_flight.popleft()
        grad = p2p.recv_backward(steps.shape(i), steps.dtype, pc)
        p2p.send_backward(steps.backward(i, hidden, out, grad), pc)


def forward_only(stage: torch.nn.Module, micro_batches: list[dict], pc: ParallelContext) -> list[torch.Tensor]:
    """Forwards of all micro-batches with no autograd state (frozen models, e.g. the DoReMi
    reference): nothing is saved for backward and no parameter receives a gradient. Returns
    the per-token losses on the last stage, [] elsewhere."""
    steps = _Steps(stage, micro_batches, pc)
    with torch.no_grad():
        for i in range(len(micro_batches)):
            out = steps.forward(i, p2p.recv_forward(steps.shape(i), steps.dtype, pc))
            p2p.send_forward(out, pc)
    return steps.losses


def broadcast_from_last_stage(tensor: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """The last stage's `tensor` on every stage of this pipeline, in place. Other stages pass a
    buffer of the same shape and dtype."""
    if pc.pp > 1:
        dist.broadcast(tensor, src=pc.stage_rank(pc.pp - 1), group=pc.pp_group)
    return tensor
