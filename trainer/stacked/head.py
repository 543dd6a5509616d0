"""The stacked head in training: logits, per-token loss and the head's gradients in one pass,
a few models at a time, so that no [M, b s, V] logits are kept for backward.

Why: at the bench shape (64 models, 4096 tokens each, vocabulary 4096; design section 4d-iii)
the logits are 2.1 GB of bf16, written by the head's bmm, read by the loss, kept, read and
written again by the loss's backward and read by the two bmm's of the head's backward: about
13 GB of memory traffic a step, a tenth of the stacked step. Model by model, one model's logits
(32 MB) are made, used five times and overwritten by their gradient (the loss's backward reads
each block of logits before it writes it, so it runs in place) while they can still be in the
GPU's L2 cache (50 MB on an H100), and nothing of them outlives the chunk.

The gradient needs the weight of each token's loss in the objective before backward: training
minimises sum over models and tokens of w[m, t] loss[m, t] (w: 1 / N_m on model m's
non-masked tokens, `trainer.stacked.run`). Each op is the unfused head's, with the same
arguments: the logits bmm, `Kernels.cross_entropy`'s kernels (Triton on CUDA, torch ops
elsewhere) with the upstream gradient w, and the two bmm's of the logits bmm's backward, the
head weight's as the transpose of autograd's (grad^T h, written into the gradient in place,
where autograd makes h^T grad and copies its transpose: the same products, summed over the
same tokens, without a strided copy of [m, V, d] per chunk); each model's numbers are computed
on its own rows, so they do not depend on the chunking.
`stacked_head_objective` returns the objective, whose backward scales the saved gradients by
the upstream gradient (1 in training: exact).
"""

from __future__ import annotations

import torch

from trainer.model.ops.cross_entropy import (
    cross_entropy_backward_torch,
    cross_entropy_backward_triton,
    cross_entropy_torch,
    cross_entropy_triton,
    triton_kernels,
)
from trainer.optim.multi_tensor import triton_runs_on

#: Logits bytes per chunk of models (at least one model a chunk): what fits in an H100's 50 MB
#: L2 with the chunk's hidden states and head weights.
CHUNK_BYTES = 32 * 2**20


def models_per_chunk(models: int, tokens: int, vocab: int, itemsize: int) -> int:
    """How many models' logits [tokens, vocab] fit in CHUNK_BYTES (at least 1, at most `models`)."""
    return max(1, min(models, CHUNK_BYTES // max(1, tokens * vocab * itemsize)))


def _loss_and_grad(
    logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, vocab_size: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V], target and weights [n] -> (loss [n] fp32, dlogits [n, V] in the logits'
    dtype): `trainer.model.ops.cross_entropy`'s forward and backward kernels, the backward
    writing over the logits where Triton runs (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if triton_runs_on(logits.device) and triton_kernels() is not None:
        loss, lse = cross_entropy_triton(logits, target, vocab_size, ignore_index)
        return loss, cross_entropy_backward_triton(weights, logits, target, lse, vocab_size, ignore_index, out=logits)
    loss, lse = cross_entropy_torch(logits, target, vocab_size, ignore_index)
    return loss, cross_entropy_backward_torch(weights, logits, target, lse, vocab_size, ignore_index)


@torch.library.custom_op("trainer::stacked_head", mutates_args=())
def stacked_head(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [M, n, d], weight [M, V, d] (one dtype), labels and weights [M, n] -> (objective
    sum(weights * loss) 0-dim fp32, loss [M, n] fp32, dh [M, n, d], dweight [M, V, d])."""
    models, n, _ = h.shape
    vocab = weight.shape[1]
    labels, weights = labels.contiguous(), weights.to(torch.float32).contiguous()
    loss = torch.empty(models, n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h)
    dweight = torch.empty_like(weight)
    step = models_per_chunk(models, n, vocab, h.element_size())
    for a in range(0, models, step):
        c = slice(a, min(a + step, models))
        wt = weight[c].transpose(1, 2)
        logits = torch.bmm(h[c], wt)
        chunk_loss, dz = _loss_and_grad(
            logits.view(-1, vocab), labels[c].reshape(-1), weights[c].reshape(-1), vocab_size, ignore_index
        )
        loss[c] = chunk_loss.view(-1, n)
        dz = dz.view(logits.shape)
        # autograd's backward of bmm(h, wt): grad @ wt^T and h^T @ grad, the latter as its
        # transpose grad^T @ h, written in place (no strided copy of [m, V, d] per chunk).
        torch.bmm(dz, wt.transpose(1, 2), out=dh[c])
        torch.bmm(dz.transpose(1, 2), h[c], out=dweight[c])
    return (weights * loss).sum(), loss, dh, dweight


@stacked_head.register_fake
def _stacked_head_fake(h, weight, labels, weights, vocab_size, ignore_index):
    loss = h.new_empty(h.shape[:2], dtype=torch.float32)
    return loss.new_empty(()), loss, torch.empty_like(h), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    _, loss, dh, dweight = output
    ctx.mark_non_differentiable(loss, dh, dweight)
    ctx.save_for_backward(dh, dweight)


def _backward(ctx, grad_objective, grad_loss, grad_dh, grad_dweight):
    dh, dweight = ctx.saved_tensors
    return dh * grad_objective.to(dh.dtype), dweight * grad_objective.to(dweight.dtype), None, None, None, None


stacked_head.register_autograd(_backward, setup_context=_setup_context)


def stacked_head_objective(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, per-token loss [M, n] fp32, not differentiable): the objective's gradient
    reaches h and weight (see the module docstring)."""
    objective, loss, _, _ = stacked_head(h, weight, labels, weights, vocab_size, ignore_index)
    return objective, loss
