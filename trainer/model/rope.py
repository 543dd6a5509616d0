"""RoPE on the fused QKV projection (rotate-half, Su et al. 2021).

`rope_qkv(qkv, cos, sin, heads, kv_heads)` splits the projection [s, b, (h + 2 kv) hd] into q, k
and v, [s, b, heads, hd] each and contiguous, with q and k rotated; attention takes permuted
views of them.

Numerics: cos and sin are rounded to the activation dtype, then the rotation runs in fp32 and
is rounded once. Against the earlier form (the products in the activation dtype, v left a view
of qkv), the compiled block no longer keeps the pre-RoPE qkv for backward: 1.3 GiB less at 1B,
the step time unchanged (experiments/PERFORMANCE.md). A hand-written Triton op for the same
rotation measured no faster than inductor's kernels for this form.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, hd]; cos, sin [s, hd / 2] (fp32) -> x rotated, in x's dtype.

    [x1 c - x2 s, x2 c + x1 s] written as x [c, c] + roll(x, hd / 2) [-s, s]: the same products
    and sums (bitwise), but pointwise over x, so that inductor fuses the backward's rotation of
    dq and dk into the `cat` that assembles the QKV gradient instead of writing them first (the
    halves' `cat` of the textbook form is a second `cat` that it does not fuse)."""
    c = cos[:, None, None, :].to(x.dtype).float()
    s = sin[:, None, None, :].to(x.dtype).float()
    xf = x.float()
    return (xf * torch.cat([c, c], dim=-1) + torch.roll(xf, x.shape[-1] // 2, dims=-1) * torch.cat([-s, s], dim=-1)
            ).to(x.dtype)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, (heads + 2 kv_heads) hd] -> q [s, b, heads, hd], k and v [s, b, kv_heads, hd], with
    RoPE (cos, sin [>= s, hd / 2], fp32) applied to q and k."""
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    cos, sin = cos[:s], sin[:s]
    return (rotate(q.view(s, b, heads, hd), cos, sin), rotate(k.view(s, b, kv_heads, hd), cos, sin),
            v.reshape(s, b, kv_heads, hd).contiguous())
