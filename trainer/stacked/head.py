"""The stacked head in training: logits, per-token loss and the head's gradients in one pass,
so that no [M, b s, V] logits are kept for backward.

Why: at the bench shape (64 models, 4096 tokens each, vocabulary 4096; design section 4d-iii)
the logits are 2 GiB of bf16. The unfused head (`StackedLlama.fused_head = False`) keeps them
from the forward to the backward, where the loss's backward allocates as much again for their
gradient: two [M, b s, V] buffers live at the start of backward, on top of every layer's saved
activations. Here the logits are made, used and overwritten by their gradient (the loss's
backward reads each block of logits before it writes it, so it runs in place) inside the
forward, and freed before the step's backward begins: one such buffer less at the step's peak
(2 GiB at the bench shape), none of it alive during the layers' backward.

All models go through each op at once, as every other stacked op (a fixed number of launches
whatever M is): a head made model by model, so that each model's 32 MB of logits could stay in
an H100's L2 cache, launched about 6 kernels per model, and the profile showed those launches
(and a per-chunk copy of the loss) costing more than the L2 saved: the unfused head was 1.6 ms
faster at 64 models (experiments/results/gpu_session9/README.md). Models are cut into chunks
only where their logits exceed CHUNK_BYTES, a bound on this op's transient memory, not a cache
size; a chunk's kernels then move at least CHUNK_BYTES / 2 each, so their launches do not count.

The gradient needs the weight of each token's loss in the objective before backward: training
minimises sum over models and tokens of w[m, t] loss[m, t] (w: 1 / N_m on model m's
non-masked tokens, `trainer.stacked.run`). Each op is the unfused head's, with the same
arguments: the logits bmm, `Kernels.cross_entropy`'s kernels (Triton on CUDA, torch ops
elsewhere) with the upstream gradient w, and the two bmm's of the logits bmm's backward, the
head weight's as the transpose of autograd's (grad^T h, written into the gradient in place,
where autograd makes h^T grad and copies its transpose: the same products, summed over the
same tokens, without a strided copy of [m, V, d]); each model's numbers are computed on its
own rows, so they do not depend on the chunking.
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

#: Logits bytes per chunk of models (at least one model a chunk): the bound on the head's
#: transient memory (the bench's 64 models, 2 GiB, are one chunk).
CHUNK_BYTES = 4 * 2**30


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
    dh = torch.empty_like(h)
    dweight = torch.empty_like(weight)
    step = models_per_chunk(models, n, vocab, h.element_size())
    losses = []
    for a in range(0, models, step):
        c = slice(a, min(a + step, models))
        wt = weight[c].transpose(1, 2)
        logits = torch.bmm(h[c], wt)
        chunk_loss, dz = _loss_and_grad(
            logits.view(-1, vocab), labels[c].reshape(-1), weights[c].reshape(-1), vocab_size, ignore_index
        )
        losses.append(chunk_loss.view(-1, n))
        dz = dz.view(logits.shape)
        # autograd's backward of bmm(h, wt): grad @ wt^T and h^T @ grad, the latter as its
        # transpose grad^T @ h, written in place (no strided copy of [m, V, d]).
        torch.bmm(dz, wt.transpose(1, 2), out=dh[c])
        torch.bmm(dz.transpose(1, 2), h[c], out=dweight[c])
    loss = losses[0] if len(losses) == 1 else torch.cat(losses)
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
