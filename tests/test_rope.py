"""RoPE on the fused QKV projection (`trainer.model.rope`) against a float64 rotate-half reference,
forward and gradient."""

from __future__ import annotations

import pytest
import torch

from trainer.model.layers import rope_tables
from trainer.model.rope import rope_qkv


def _reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv: int):
    """float64 rotate-half RoPE by the formula: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv)
    x = qkv.double().view(s, b, heads + 2 * kv, hd)
    c, sn = cos.double()[:, None, None, :], sin.double()[:, None, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rot = torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)
    return rot[:, :, :heads], rot[:, :, heads:heads + kv], x[:, :, heads + kv:]


@pytest.mark.parametrize("s,b,heads,kv,hd", [(5, 3, 4, 2, 8), (7, 2, 6, 3, 6), (4, 1, 2, 2, 16)])
def test_torch_path_matches_float64_rotation_and_autograd(s, b, heads, kv, hd):
    g = torch.Generator().manual_seed(s * 100 + hd)
    cos, sin = rope_tables(s + 2, hd, 10000.0)
    qkv = torch.randn(s, b, (heads + 2 * kv) * hd, generator=g, requires_grad=True)
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv)
    rq, rk, rv = _reference(qkv.detach(), cos[:s], sin[:s], heads, kv)
    for got, ref in ((q, rq), (k, rk), (v, rv)):
        assert got.shape == ref.shape and got.is_contiguous()
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    grads = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
    torch.autograd.backward([q, k, v], grads)
    x = qkv.detach().double().requires_grad_()
    torch.autograd.backward(list(_reference(x, cos[:s], sin[:s], heads, kv)), [t.double() for t in grads])
    torch.testing.assert_close(qkv.grad.double(), x.grad, rtol=1e-6, atol=1e-6)


def test_bf16_is_rounded_once_from_fp32():
    """With cos and sin rounded to bf16 first, each output is the float64 rotation rounded once
    to bf16: within half a bf16 step (2^-8 relative), up to fp32 noise."""
    g = torch.Generator().manual_seed(7)
    s, b, heads, kv, hd = 9, 2, 4, 2, 16
    cos, sin = rope_tables(s, hd, 10000.0)
    qkv = torch.randn(s, b, (heads + 2 * kv) * hd, generator=g).bfloat16()
    got = rope_qkv(qkv, cos, sin, heads, kv)
    want = _reference(qkv, cos.bfloat16().double(), sin.bfloat16().double(), heads, kv)
    for t, w in zip(got, want):
        assert t.dtype == torch.bfloat16
        assert bool(((t.double() - w).abs() <= 2.0 ** -8 * w.abs() + 1e-6).all())
