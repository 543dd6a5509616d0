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

    The halves joined by `cat`. The same products written pointwise, x [c, c] + roll(x, hd / 2)
    [-s, s] (bitwise equal), meant to let inductor fuse the backward into the QKV-gradient
    `cat`, measured slower: one layer's RoPE + attention 2.35 vs 1.96 ms forward and backward,
    the 1B step 1.3% slower (experiments/PERFORMANCE.md, run 10)."""
    c = cos[:, None, None, :].to(x.dtype).float()
    s = sin[:, None, None, :].to(x.dtype).float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


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
