"""Per-token cross entropy over unsharded logits, `trainer::cross_entropy`: the loss of the
compiled head at tp = 1 (`trainer.model.llama`; eager and tp > 1 use the vocabulary-parallel
one, which keeps less memory).

loss = logsumexp(z[:vocab_size]) - z[target] in fp32 from logits in their own dtype (bf16),
0 where target == ignore_index; the columns past vocab_size (padding) are not part of the
softmax and get zero gradient. One custom op pair, so that `torch.compile` keeps each as one
call:
- forward, on CUDA a Triton kernel: one program per token reads its row of logits once,
  keeping a running max and sum of exponentials per lane (online softmax, Milakov & Gimelshein
  2018), and saves the fp32 logsumexp (4 bytes per token). What inductor made of
  `F.cross_entropy(z.float())` read the 1B bench's 1 GiB of bf16 logits at 1.2 TB/s (0.87 ms
  a step; experiments/notes/PERFORMANCE.md);
- backward: dz = g (softmax(z) - onehot(target)) from the logits and the saved logsumexp, one
  read and one write of the logits;
- elsewhere (CPU, or no Triton), the same math in torch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from trainer.model.ops.dispatch import triton_kernels_of, triton_or_torch

#: Columns per loop iteration (forward) or per program (backward).
BLOCK = 2048


def _accumulation(x: torch.Tensor) -> torch.Tensor:
    """fp32, or x's dtype where wider (float64 references)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def cross_entropy_torch(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V >= vocab_size], target [n] -> (loss [n] fp32, logsumexp [n] fp32), torch ops."""
    z = _accumulation(logits[:, :vocab_size])
    lse = torch.logsumexp(z, dim=-1)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none")
    return loss, lse


def cross_entropy_backward_torch(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
) -> torch.Tensor:
    g = torch.where(target == ignore_index, 0.0, _accumulation(grad))
    p = torch.exp(_accumulation(logits[:, :vocab_size]) - lse[:, None])
    p.scatter_add_(1, torch.where(target == ignore_index, 0, target)[:, None], -torch.ones_like(g)[:, None])
    out = torch.zeros_like(logits)
    out[:, :vocab_size] = (p * g[:, None]).to(logits.dtype)
    return out


@functools.cache
def triton_kernels():
    """(forward, backward) Triton kernels (`trainer.model.ops.cross_entropy_triton`), or None
    without Triton; built on first use (trainer.model.ops.dispatch)."""
    return triton_kernels_of(
        "trainer.model.ops.cross_entropy_triton", "cross_entropy_forward_kernel", "cross_entropy_backward_kernel"
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def cross_entropy_triton(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _ = triton_kernels()
    logits, target = _rows(logits), target.contiguous()
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        forward[(n,)](
            logits, target, loss, lse, vocab_size, logits.stride(0), ignore_index, BLOCK_SIZE=BLOCK, num_warps=8
        )
    return loss, lse


def cross_entropy_backward_triton(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dlogits [n, V] in the logits' dtype, into `out` when given (which may be `logits` itself:
    each program reads its block of a row before writing it; the stacked head,
    trainer/stacked/head.py, writes the gradient over the logits it no longer needs)."""
    _, backward = triton_kernels()
    logits, target, grad = _rows(logits), target.contiguous(), grad.contiguous()
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    n, cols = logits.shape
    if out.numel():
        backward[(n, -(-cols // BLOCK))](
            grad,
            logits,
            target,
            lse,
            out,
            vocab_size,
            cols,
            logits.stride(0),
            out.stride(0),
            ignore_index,
            BLOCK_SIZE=BLOCK,
            num_warps=8,
        )
    return out


cross_entropy_op = torch.library.custom_op("trainer::cross_entropy", cross_entropy_torch, mutates_args=())
cross_entropy_op.register_kernel("cuda", triton_or_torch(triton_kernels, cross_entropy_torch, cross_entropy_triton))


@cross_entropy_op.register_fake
def _cross_entropy_fake(logits, target, vocab_size, ignore_index):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


cross_entropy_backward_op = torch.library.custom_op(
    "trainer::cross_entropy_backward", cross_entropy_backward_torch, mutates_args=()
)
cross_entropy_backward_op.register_kernel(
    "cuda", triton_or_torch(triton_kernels, cross_entropy_backward_torch, cross_entropy_backward_triton)
)


@cross_entropy_backward_op.register_fake
def _cross_entropy_backward_fake(grad, logits, target, lse, vocab_size, ignore_index):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output) -> None:
    logits, target, vocab_size, ignore_index = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.vocab_size, ctx.ignore_index = vocab_size, ignore_index


def _backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    return cross_entropy_backward_op(grad_loss, logits, target, lse, ctx.vocab_size, ctx.ignore_index), None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """logits [..., V >= vocab_size], target [...] -> per-token loss [...] fp32 (see the module
    docstring). The logsumexp output is for backward only (its gradient is not supported)."""
    loss, _ = cross_entropy_op(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_size, ignore_index)
    return loss.view(target.shape)
