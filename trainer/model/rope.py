"""RoPE on the fused QKV projection, as custom ops (rotate-half, Su et al. 2021).

`rope_qkv(qkv, cos, sin, heads, kv_heads)` splits the projection [s, b, (h + 2 kv) hd] into q, k
and v, [s, b, heads, hd] each and contiguous, with q and k rotated. The backward applies the
inverse rotation and writes the gradient of the whole projection at once.

Why a custom op: inductor fuses the split, the rotation and the layout change that SDPA
needs into one kernel, which ran at about 1 TB/s on an H200 (2.5 ms of a 1B step,
experiments/PERFORMANCE.md). Here one Triton program reads one token's q and k heads once and
writes them once, in the [s, b, heads, hd] layout; attention then takes permuted views of them.
On the CPU, or without Triton, the ops run the same math in torch.

Numerics: cos and sin are rounded to the activation dtype first, then everything runs in fp32
and is rounded once, which is what inductor computes for `apply_rope` in a compiled block.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [s, b, heads, hd]; cos, sin [s, hd / 2] -> the rotated x (the transpose rotation when
    `inverse`), computed in fp32 with cos and sin rounded to x's dtype."""
    c = cos[:, None, None, :].to(x.dtype).float()
    s = sin[:, None, None, :].to(x.dtype).float()
    if inverse:
        s = -s
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _split(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    return q.view(s, b, heads, hd), k.view(s, b, kv_heads, hd), v.view(s, b, kv_heads, hd)


def rope_qkv_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                   kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _split(qkv, heads, kv_heads)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def rope_qkv_backward_torch(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    s, b = dq.shape[:2]
    parts = (_rotate(dq, cos, sin, inverse=True), _rotate(dk, cos, sin, inverse=True), dv)
    return torch.cat([p.reshape(s, b, -1) for p in parts], dim=-1)


@functools.cache
def triton_kernels():
    """(forward, backward) Triton kernels, or None without Triton; built on first use so that
    TRITON_INTERPRET=1 (the tests' CPU mode) is read when they are made."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def rope_forward_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, batch, heads, kv_heads, half,
                            qkv_row, HEADS: tl.constexpr, HALF: tl.constexpr):
        """One program per token (s, b): q and k heads rotated, v copied, all [s, b, heads, hd]."""
        row = tl.program_id(0).to(tl.int64)
        pos = row // batch
        hd = 2 * half
        rows = tl.arange(0, HEADS)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        src = qkv_ptr + row * qkv_row
        # q and k: rows < heads are q heads, the next kv_heads rows are k heads (adjacent in qkv).
        rotated = heads + kv_heads
        mask = (rows < rotated) & (cols < half)
        x1 = tl.load(src + rows * hd + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + rows * hd + half + cols, mask=mask, other=0.0).to(tl.float32)
        half_cols = tl.arange(0, HALF)
        c = tl.load(cos_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
        sn = tl.load(sin_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
        c = c.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
        sn = sn.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
        y1 = x1 * c - x2 * sn
        y2 = x2 * c + x1 * sn
        in_q = rows < heads
        dst = tl.where(in_q, q_ptr + row * heads * hd + rows * hd,
                       k_ptr + row * kv_heads * hd + (rows - heads) * hd)
        tl.store(dst + cols, y1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + cols, y2.to(q_ptr.dtype.element_ty), mask=mask)
        vcols = tl.arange(0, 2 * HALF)[None, :]
        vmask = (rows < kv_heads) & (vcols < hd)
        v = tl.load(src + rotated * hd + rows * hd + vcols, mask=vmask, other=0.0)
        tl.store(v_ptr + row * kv_heads * hd + rows * hd + vcols, v, mask=vmask)

    @triton.jit
    def rope_backward_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr, batch, heads, kv_heads, half,
                             dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h,
                             HEADS: tl.constexpr, HALF: tl.constexpr):
        """One program per token: the inverse rotation of dq and dk and dv, into one row of the
        projection's gradient. The incoming gradients may have any strides (last dim dense)."""
        row = tl.program_id(0).to(tl.int64)
        pos = row // batch
        bi = row % batch
        hd = 2 * half
        rows = tl.arange(0, HEADS)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        rotated = heads + kv_heads
        mask = (rows < rotated) & (cols < half)
        in_q = rows < heads
        src = tl.where(in_q, dq_ptr + pos * dq_s + bi * dq_b + rows * dq_h,
                       dk_ptr + pos * dk_s + bi * dk_b + (rows - heads) * dk_h)
        g1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
        half_cols = tl.arange(0, HALF)
        c = tl.load(cos_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
        sn = tl.load(sin_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
        c = c.to(out_ptr.dtype.element_ty).to(tl.float32)[None, :]
        sn = sn.to(out_ptr.dtype.element_ty).to(tl.float32)[None, :]
        y1 = g1 * c + g2 * sn
        y2 = g2 * c - g1 * sn
        dst = out_ptr + row * (rotated + kv_heads) * hd + rows * hd
        tl.store(dst + cols, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + cols, y2.to(out_ptr.dtype.element_ty), mask=mask)
        vcols = tl.arange(0, 2 * HALF)[None, :]
        vmask = (rows < kv_heads) & (vcols < hd)
        dv = tl.load(dv_ptr + pos * dv_s + bi * dv_b + rows * dv_h + vcols, mask=vmask, other=0.0)
        tl.store(out_ptr + row * (rotated + kv_heads) * hd + (rotated + rows) * hd + vcols, dv, mask=vmask)

    return rope_forward_kernel, rope_backward_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    forward, _ = triton_kernels()
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    qkv = qkv if qkv.stride(2) == 1 and qkv.stride(0) == b * qkv.stride(1) else qkv.contiguous()
    q = qkv.new_empty(s, b, heads, hd)
    k = qkv.new_empty(s, b, kv_heads, hd)
    v = qkv.new_empty(s, b, kv_heads, hd)
    if q.numel():
        forward[(s * b,)](qkv, cos.contiguous(), sin.contiguous(), q, k, v, b, heads, kv_heads, hd // 2,
                          qkv.stride(1), HEADS=_pow2(heads + kv_heads), HALF=_pow2(hd // 2))
    return q, k, v


def rope_qkv_backward_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    _, backward = triton_kernels()
    s, b, heads, hd = dq.shape
    kv_heads = dk.shape[2]
    dq, dk, dv = _dense_last(dq), _dense_last(dk), _dense_last(dv)
    out = dq.new_empty(s, b, (heads + 2 * kv_heads) * hd)
    if out.numel():
        backward[(s * b,)](dq, dk, dv, cos.contiguous(), sin.contiguous(), out, b, heads, kv_heads, hd // 2,
                           *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
                           HEADS=_pow2(heads + kv_heads), HALF=_pow2(hd // 2))
    return out


@torch.library.custom_op("doremi::rope_qkv", mutates_args=())
def rope_qkv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rope_qkv_torch(qkv, cos, sin, heads, kv_heads)


@rope_qkv_op.register_kernel("cuda")
def _rope_qkv_cuda(qkv, cos, sin, heads, kv_heads):
    if triton_kernels() is None:
        return rope_qkv_torch(qkv, cos, sin, heads, kv_heads)
    return rope_qkv_triton(qkv, cos, sin, heads, kv_heads)


@rope_qkv_op.register_fake
def _rope_qkv_fake(qkv, cos, sin, heads, kv_heads):
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    return qkv.new_empty(s, b, heads, hd), qkv.new_empty(s, b, kv_heads, hd), qkv.new_empty(s, b, kv_heads, hd)


@torch.library.custom_op("doremi::rope_qkv_backward", mutates_args=())
def rope_qkv_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
    return rope_qkv_backward_torch(dq, dk, dv, cos, sin)


@rope_qkv_backward_op.register_kernel("cuda")
def _rope_qkv_backward_cuda(dq, dk, dv, cos, sin):
    if triton_kernels() is None:
        return rope_qkv_backward_torch(dq, dk, dv, cos, sin)
    return rope_qkv_backward_triton(dq, dk, dv, cos, sin)


@rope_qkv_backward_op.register_fake
def _rope_qkv_backward_fake(dq, dk, dv, cos, sin):
    s, b, heads, hd = dq.shape
    return dq.new_empty(s, b, (heads + 2 * dk.shape[2]) * hd)


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads):
        ctx.save_for_backward(cos, sin)
        return rope_qkv_op(qkv, cos, sin, heads, kv_heads)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return rope_qkv_backward_op(dq, dk, dv, cos, sin), None, None, None, None


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, (heads + 2 kv_heads) hd] -> q [s, b, heads, hd], k and v [s, b, kv_heads, hd], with
    RoPE (cos, sin [>= s, hd / 2], fp32) applied to q and k."""
    s = qkv.shape[0]
    return _RopeQKV.apply(qkv, cos[:s], sin[:s], heads, kv_heads)
