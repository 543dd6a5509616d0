"""The Triton programs of `trainer.model.ops.rope`: one program per token for the forward (q and
k rotated, v copied) and one for the backward (the inverse rotation of dq and dk, and dv, into
one row of the projection's gradient). Imported only by `rope.triton_kernels`, on first use, so
that importing the model never needs Triton and TRITON_INTERPRET=1 (the tests' CPU mode) is read
when the programs are made."""

import triton
import triton.language as tl


@triton.jit
def rope_forward_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    batch,
    heads,
    kv_heads,
    half,
    qkv_s,
    qkv_b,
    q_s,
    q_b,
    kv_s,
    kv_b,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    """One program per token (s, b): q and k heads rotated, v copied, all [s, b, heads, hd] with
    token strides (q_s, q_b) and (kv_s, kv_b) for k and v (heads dense within a token)."""
    row = tl.program_id(0).to(tl.int64)
    pos = row // batch
    bi = row % batch
    hd = 2 * half
    rows = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    src = qkv_ptr + pos * qkv_s + bi * qkv_b
    # Rows < heads are q heads, the next kv_heads rows k heads (adjacent in qkv).
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
    dst = tl.where(
        rows < heads, q_ptr + pos * q_s + bi * q_b + rows * hd, k_ptr + pos * kv_s + bi * kv_b + (rows - heads) * hd
    )
    tl.store(dst + cols, y1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + cols, y2.to(q_ptr.dtype.element_ty), mask=mask)
    vcols = tl.arange(0, 2 * HALF)[None, :]
    vmask = (rows < kv_heads) & (vcols < hd)
    v = tl.load(src + rotated * hd + rows * hd + vcols, mask=vmask, other=0.0)
    tl.store(v_ptr + pos * kv_s + bi * kv_b + rows * hd + vcols, v, mask=vmask)


@triton.jit
def rope_backward_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    batch,
    heads,
    kv_heads,
    half,
    dq_s,
    dq_b,
    dq_h,
    dk_s,
    dk_b,
    dk_h,
    dv_s,
    dv_b,
    dv_h,
    out_s,
    out_b,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    """One program per token: the inverse rotation of dq and dk, and dv, into one row of the
    projection's gradient (token strides out_s, out_b). The incoming gradients may have any
    strides (last dim dense)."""
    row = tl.program_id(0).to(tl.int64)
    pos = row // batch
    bi = row % batch
    hd = 2 * half
    rows = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    rotated = heads + kv_heads
    mask = (rows < rotated) & (cols < half)
    src = tl.where(
        rows < heads,
        dq_ptr + pos * dq_s + bi * dq_b + rows * dq_h,
        dk_ptr + pos * dk_s + bi * dk_b + (rows - heads) * dk_h,
    )
    g1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
    half_cols = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
    sn = tl.load(sin_ptr + pos * half + half_cols, mask=half_cols < half, other=0.0)
    c = c.to(out_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sn = sn.to(out_ptr.dtype.element_ty).to(tl.float32)[None, :]
    y1 = g1 * c + g2 * sn
    y2 = g2 * c - g1 * sn
    token = out_ptr + pos * out_s + bi * out_b
    dst = token + rows * hd
    tl.store(dst + cols, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + cols, y2.to(out_ptr.dtype.element_ty), mask=mask)
    vcols = tl.arange(0, 2 * HALF)[None, :]
    vmask = (rows < kv_heads) & (vcols < hd)
    dv = tl.load(dv_ptr + pos * dv_s + bi * dv_b + rows * dv_h + vcols, mask=vmask, other=0.0)
    tl.store(token + (rotated + rows) * hd + vcols, dv, mask=vmask)
