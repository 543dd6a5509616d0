"""RoPE on the fused QKV projection (`trainer.model.ops.rope`) against a float64 rotate-half reference,
forward and gradient: the custom ops' torch path, their registration, and the Triton kernels
(Triton's CPU interpreter) against the torch path."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import needs_triton, run_interpreted
from trainer.model.layers import rope_tables
from trainer.model.ops.rope import rope_qkv, rope_qkv_backward_op, rope_qkv_op, rope_qkv_torch


def _reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv: int):
    """float64 rotate-half RoPE by the formula: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv)
    x = qkv.double().view(s, b, heads + 2 * kv, hd)
    c, sn = cos.double()[:, None, None, :], sin.double()[:, None, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rot = torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)
    return rot[:, :, :heads], rot[:, :, heads : heads + kv], x[:, :, heads + kv :]


def _laid_out(t: torch.Tensor, batch_first: bool) -> bool:
    """t [s, b, ...] is contiguous, or (batch_first) the [s, b] view of a contiguous [b, s, ...]."""
    return t.transpose(0, 1).is_contiguous() if batch_first else t.is_contiguous()


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("s,b,heads,kv,hd", [(5, 3, 4, 2, 8), (7, 2, 6, 3, 6), (4, 1, 2, 2, 16)])
def test_torch_path_matches_float64_rotation_and_autograd(s, b, heads, kv, hd, batch_first):
    """Values and gradients by the formula; `batch_first` lays q, k, v and the projection's
    gradient out batch-major in memory, the same values."""
    g = torch.Generator().manual_seed(s * 100 + hd)
    cos, sin = rope_tables(s + 2, hd, 10000.0)
    qkv = torch.randn(s, b, (heads + 2 * kv) * hd, generator=g, requires_grad=True)
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv, batch_first=batch_first)
    rq, rk, rv = _reference(qkv.detach(), cos[:s], sin[:s], heads, kv)
    for got, ref in ((q, rq), (k, rk), (v, rv)):
        assert got.shape == ref.shape and _laid_out(got, batch_first)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    grads = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
    torch.autograd.backward([q, k, v], grads)
    x = qkv.detach().double().requires_grad_()
    torch.autograd.backward(list(_reference(x, cos[:s], sin[:s], heads, kv)), [t.double() for t in grads])
    torch.testing.assert_close(qkv.grad.double(), x.grad, rtol=1e-6, atol=1e-6)
    dq, dk, dv = grads
    assert _laid_out(rope_qkv_backward_op(dq, dk, dv, cos[:s], sin[:s], batch_first), batch_first)


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
        assert bool(((t.double() - w).abs() <= 2.0**-8 * w.abs() + 1e-6).all())


def test_custom_ops_registration():
    g = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(6, 8, 10000.0)
    qkv = torch.randn(6, 2, (4 + 2 * 2) * 8, generator=g)
    torch.library.opcheck(rope_qkv_op, (qkv, cos, sin, 4, 2))
    torch.library.opcheck(rope_qkv_op, (qkv.transpose(0, 1).contiguous().transpose(0, 1), cos, sin, 4, 2, True))
    q, k, v = rope_qkv_torch(qkv, cos, sin, 4, 2)
    dq, dk, dv = (torch.randn(t.shape, generator=g) for t in (q, k, v))
    torch.library.opcheck(rope_qkv_backward_op, (dq, dk, dv, cos, sin))
    torch.library.opcheck(rope_qkv_backward_op, (dq, dk, dv, cos, sin, True))
    one = torch.randn(1, 1, (4 + 2 * 2) * 8, generator=g)  # one token: v must still be a new tensor
    torch.library.opcheck(rope_qkv_op, (one, cos[:1], sin[:1], 4, 2))


@needs_triton
def test_triton_kernels_match_the_torch_path_in_the_interpreter():
    """Head counts and head dims that are not powers of two, a qkv with a row stride wider than
    its rows, incoming gradients in SDPA's permuted layout, fp32 (to rounding) and bf16; outputs
    sequence-major and (`batch_first`) batch-major in memory."""
    run_interpreted("""
import torch
from trainer.model.ops import rope as r
from trainer.model.layers import rope_tables
assert r.triton_kernels() is not None, "triton is not importable"
def close(got, want, tol):
    return bool(((got.double() - want.double()).abs() <= tol * (want.double().abs() + 1.0)).all())
g = torch.Generator().manual_seed(0)
for s, b, heads, kv, hd in [(5, 3, 4, 2, 8), (7, 2, 6, 3, 6), (3, 1, 2, 2, 16), (4, 2, 3, 1, 10)]:
    cos, sin = rope_tables(s, hd, 10000.0)
    width = (heads + 2 * kv) * hd
    # bf16: the interpreter truncates fp32 -> bf16 (the GPU rounds) for cos, sin and the result,
    # so up to a few bf16 steps (2^-7 relative each) apart.
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -5)):
        wide = torch.randn(s, b, width + 6, generator=g).to(dtype)
        # Rows wider than the projection, and the batch-major layout (batch 1 included, whose
        # stride torch's contiguity ignores).
        for qkv in (wide[..., 2:-4], torch.randn(b, s, width, generator=g).to(dtype).transpose(0, 1),
                    torch.randn(1, s, width, generator=g).to(dtype).transpose(0, 1)):
            for bf in (False, True):  # outputs sequence-major, or batch-major in memory
                out = r.rope_qkv_triton(qkv, cos, sin, heads, kv, bf)
                ref = r.rope_qkv_torch(qkv, cos, sin, heads, kv)
                for got, want in zip(out, ref):
                    assert got.dtype == dtype and got.shape == want.shape
                    assert (got.transpose(0, 1) if bf else got).is_contiguous(), got.stride()
                    assert close(got, want, tol), (s, hd, dtype, qkv.stride(), bf)
        dq = torch.randn(b, heads, s, hd, generator=g).to(dtype).permute(2, 0, 1, 3)
        dk = torch.randn(s, b, kv, hd, generator=g).to(dtype)
        dv = torch.randn(b, kv, s, hd, generator=g).to(dtype).permute(2, 0, 1, 3)
        want = r.rope_qkv_backward_torch(dq, dk, dv, cos, sin)
        for bf in (False, True):
            got = r.rope_qkv_backward_triton(dq, dk, dv, cos, sin, bf)
            assert got.shape == (s, b, width) and got.dtype == dtype
            assert (got.transpose(0, 1) if bf else got).is_contiguous(), got.stride()
            assert close(got, want, tol), ("backward", s, hd, dtype, bf)
print("ok")
""")
