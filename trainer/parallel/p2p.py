"""Point-to-point transfers between neighbouring pipeline stages.

Activations flow from stage p to p + 1, gradients from p + 1 to p, always between the same
(dp, tp) position (`ParallelContext.stage_rank`). Shapes and dtypes are known on both sides
(`stage.activation_shape`), so no metadata is exchanged and the NCCL path never syncs the host.

Every transfer posts all of its sends and receives before waiting on any of them. This matters:
a gloo send of a large tensor does not complete until the peer has posted the matching receive,
and NCCL send and receive kernels block on their peers, so "send, then receive" on two
neighbours that both send first deadlocks. On CUDA the ops are grouped with
`batch_isend_irecv` (one NCCL group call, as Megatron does); on CPU (gloo) they are posted as
individual `isend`/`irecv`, which gloo supports in every torch version we target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer.parallel.context import ParallelContext

#: A tensor and the global rank of the peer it goes to or comes from.
Pair = tuple[torch.Tensor, int]


def exchange(sends: list[Pair], recvs: list[Pair], group: dist.ProcessGroup | None = None) -> None:
    """Post every send and receive (tensor, global peer rank) within `group` (the pipeline
    group, as Megatron does; None: the default group), then wait for all of them.

    After this returns, received tensors are usable on the current stream and sent tensors may
    be freed or overwritten."""
    if not sends and not recvs:
        return
    tensors = [t for t, _ in sends] + [t for t, _ in recvs]
    if tensors[0].is_cuda:
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        works = dist.batch_isend_irecv(ops)
    else:
        works = [dist.isend(t, peer, group=group) for t, peer in sends] + [
            dist.irecv(t, peer, group=group) for t, peer in recvs
        ]
    for w in works:
        w.wait()


def _receive(
    shape: tuple[int, ...], dtype: torch.dtype, pc: ParallelContext, peer: int, sends: Sequence[Pair] = ()
) -> torch.Tensor:
    """A fresh buffer received from `peer`, in one exchange with `sends` (the four receiving
    calls below differ only in their peer, what they send alongside, and their edge stage)."""
    buf = torch.empty(shape, dtype=dtype, device=pc.device)
    exchange(list(sends), [(buf, peer)], pc.pp_group)
    return buf


def _next(pc: ParallelContext) -> int:
    return pc.stage_rank(pc.pp_rank + 1)


def _prev(pc: ParallelContext) -> int:
    return pc.stage_rank(pc.pp_rank - 1)


def recv_forward(shape: tuple[int, ...], dtype: torch.dtype, pc: ParallelContext) -> torch.Tensor | None:
    """The previous stage's activation; None on the first stage."""
    return None if pc.is_first_stage else _receive(shape, dtype, pc, _prev(pc))


def send_forward(output: torch.Tensor, pc: ParallelContext) -> None:
    if not pc.is_last_stage:
        exchange([(output.detach().contiguous(), _next(pc))], [], pc.pp_group)


def recv_backward(shape: tuple[int, ...], dtype: torch.dtype, pc: ParallelContext) -> torch.Tensor | None:
    """The gradient of this stage's output from the next stage; None on the last stage."""
    return None if pc.is_last_stage else _receive(shape, dtype, pc, _next(pc))


def send_backward(input_grad: torch.Tensor | None, pc: ParallelContext) -> None:
    if not pc.is_first_stage:
        exchange([(_checked_grad(input_grad), _prev(pc))], [], pc.pp_group)


def send_forward_recv_backward(
    output: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, pc: ParallelContext
) -> torch.Tensor | None:
    """1F1B steady state: hand the output on and receive the gradient of an earlier output."""
    if pc.is_last_stage:
        return None
    return _receive(shape, dtype, pc, _next(pc), [(output.detach().contiguous(), _next(pc))])


def send_backward_recv_forward(
    input_grad: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, pc: ParallelContext
) -> torch.Tensor | None:
    """1F1B steady state: hand the input gradient back and receive the next input."""
    if pc.is_first_stage:
        return None
    return _receive(shape, dtype, pc, _prev(pc), [(_checked_grad(input_grad), _prev(pc))])


def _checked_grad(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        raise RuntimeError("pipeline: a stage input received no gradient (is its output detached from its input?)")
    return grad.contiguous()
