"""RoPE on the fused QKV projection (rotate-half, Su et al. 2021), as a pair of custom ops.

`rope_qkv(qkv, cos, sin, heads, kv_heads)` splits the projection [s, b, (h + 2 kv) hd] into q, k
and v, [s, b, heads, hd] each and contiguous, with q and k rotated; attention takes permuted
views of them. The backward applies the inverse rotation to dq and dk (in whatever layout
attention returns them) and writes the gradient of the whole projection, dv included, at once.

Why custom ops: inductor splits the same torch ops into five kernels per layer (the rotation of
q, of k, the copy of v, and in backward the inverse rotations and the `cat` that assembles the
projection's gradient), 2.78 ms of a 1B step on an H200; one Triton program per token that reads
its row once and writes it once takes 1.57 ms (experiments/notes/PERFORMANCE.md). The first timing of
these ops against inductor's (a single layer, wall time) was bound by host launch latency and
looked slower; in the step the host runs ahead and only the kernels count. On the CPU, or
without Triton, the ops run `rope_qkv_torch`.

Numerics: cos and sin are rounded to the activation dtype, then the rotation runs in fp32 and
is rounded once (inductor's result for the torch ops, up to fp32 contraction). Against the
earlier form (the products in the activation dtype, v a view of qkv), the compiled block keeps
no pre-RoPE qkv for backward: 1.3 GiB less at 1B.
"""

from __future__ import annotations

import functools

import torch

from trainer.model.ops.dispatch import triton_kernels_of, triton_or_torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, hd]; cos, sin [s, hd / 2] (fp32) -> x rotated, in x's dtype. (The inverse
    rotation is `rotate(x, cos, -sin)`.)"""
    c = cos[:, None, None, :].to(x.dtype).float()
    s = sin[:, None, None, :].to(x.dtype).float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def new_tokens(like: torch.Tensor, s: int, b: int, *rest: int, batch_first: bool) -> torch.Tensor:
    """An empty [s, b, *rest] in `like`'s dtype and device: contiguous, or (`batch_first`) the
    [s, b] view of a contiguous [b, s, *rest], batch-major in memory."""
    if batch_first:
        return like.new_empty(b, s, *rest).transpose(0, 1)
    return like.new_empty(s, b, *rest)


def _laid_out(t: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """t [s, b, ...] in `new_tokens`' layout (the torch path's results, computed contiguous)."""
    return new_tokens(t, t.shape[0], t.shape[1], *t.shape[2:], batch_first=batch_first).copy_(t) if batch_first else t


def rope_qkv_torch(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, batch_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_qkv` in torch ops (autograd differentiates it)."""
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    cos, sin = cos[:s], sin[:s]
    out = (
        rotate(q.view(s, b, heads, hd), cos, sin),
        rotate(k.view(s, b, kv_heads, hd), cos, sin),
        v.reshape(s, b, kv_heads, hd).clone(memory_format=torch.contiguous_format),
    )
    return tuple(_laid_out(t, batch_first) for t in out)


def rope_qkv_backward_torch(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch_first: bool = False,
) -> torch.Tensor:
    """The projection's gradient [s, b, (h + 2 kv) hd] from dq, dk, dv [s, b, heads, hd]."""
    s, b = dq.shape[:2]
    parts = (rotate(dq, cos, -sin), rotate(dk, cos, -sin), dv)
    return _laid_out(torch.cat([p.reshape(s, b, -1) for p in parts], dim=-1), batch_first)


@functools.cache
def triton_kernels():
    """(forward, backward) Triton kernels (`trainer.model.ops.rope_triton`), or None without
    Triton; built on first use (trainer.model.ops.dispatch)."""
    return triton_kernels_of("trainer.model.ops.rope_triton", "rope_forward_kernel", "rope_backward_kernel")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_qkv_triton(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, batch_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel; qkv [s, b, width] of any strides with dense rows."""
    forward, _ = triton_kernels()
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    qkv = _dense_last(qkv)
    q = new_tokens(qkv, s, b, heads, hd, batch_first=batch_first)
    k = new_tokens(qkv, s, b, kv_heads, hd, batch_first=batch_first)
    v = new_tokens(qkv, s, b, kv_heads, hd, batch_first=batch_first)
    if q.numel():
        forward[(s * b,)](
            qkv,
            cos.contiguous(),
            sin.contiguous(),
            q,
            k,
            v,
            b,
            heads,
            kv_heads,
            hd // 2,
            qkv.stride(0),
            qkv.stride(1),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            HEADS=_pow2(heads + kv_heads),
            HALF=_pow2(hd // 2),
        )
    return q, k, v


def rope_qkv_backward_triton(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch_first: bool = False,
) -> torch.Tensor:
    """The backward kernel; dq, dk, dv [s, b, heads, hd] of any strides."""
    _, backward = triton_kernels()
    s, b, heads, hd = dq.shape
    kv_heads = dk.shape[2]
    dq, dk, dv = _dense_last(dq), _dense_last(dk), _dense_last(dv)
    out = new_tokens(dq, s, b, (heads + 2 * kv_heads) * hd, batch_first=batch_first)
    if out.numel():
        backward[(s * b,)](
            dq,
            dk,
            dv,
            cos.contiguous(),
            sin.contiguous(),
            out,
            b,
            heads,
            kv_heads,
            hd // 2,
            *dq.stride()[:3],
            *dk.stride()[:3],
            *dv.stride()[:3],
            out.stride(0),
            out.stride(1),
            HEADS=_pow2(heads + kv_heads),
            HALF=_pow2(hd // 2),
        )
    return out


rope_qkv_op = torch.library.custom_op("trainer::rope_qkv", rope_qkv_torch, mutates_args=())
rope_qkv_op.register_kernel("cuda", triton_or_torch(triton_kernels, rope_qkv_torch, rope_qkv_triton))


@rope_qkv_op.register_fake
def _rope_qkv_fake(qkv, cos, sin, heads, kv_heads, batch_first=False):
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    return tuple(new_tokens(qkv, s, b, n, hd, batch_first=batch_first) for n in (heads, kv_heads, kv_heads))


rope_qkv_backward_op = torch.library.custom_op("trainer::rope_qkv_backward", rope_qkv_backward_torch, mutates_args=())
rope_qkv_backward_op.register_kernel(
    "cuda", triton_or_torch(triton_kernels, rope_qkv_backward_torch, rope_qkv_backward_triton)
)


@rope_qkv_backward_op.register_fake
def _rope_qkv_backward_fake(dq, dk, dv, cos, sin, batch_first=False):
    s, b, heads, hd = dq.shape
    return new_tokens(dq, s, b, (heads + 2 * dk.shape[2]) * hd, batch_first=batch_first)


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads, batch_first):
        ctx.save_for_backward(cos, sin)
        ctx.batch_first = batch_first
        return rope_qkv_op(qkv, cos, sin, heads, kv_heads, batch_first)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return rope_qkv_backward_op(dq, dk, dv, cos, sin, ctx.batch_first), None, None, None, None, None


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, batch_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, (heads + 2 kv_heads) hd] -> q [s, b, heads, hd], k and v [s, b, kv_heads, hd], with
    RoPE (cos, sin [>= s, hd / 2], fp32) applied to q and k. `batch_first`: q, k, v and, in
    backward, the projection's gradient are batch-major in memory ([s, b] views of [b, s]
    tensors; `new_tokens`), as a batch-first model's attention and linears read them: DoGE's
    one pass (`trainer.model.llama.Attention.batch_first`), where the sequence-major outputs
    cost three copies a layer (attention's output and its gradient re-laid out by inductor, the
    projection's gradient made contiguous: 3.7 ms of a 1B step on one H100, 16th session)."""
    s = qkv.shape[0]
    return _RopeQKV.apply(qkv, cos[:s], sin[:s], heads, kv_heads, batch_first)
