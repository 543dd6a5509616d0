"""RMSNorm's backward for DoGE's one pass (trainer/model/ops/group_norm_backward.py): the torch
path against autograd's float64 backward of the norm, with and without the residual stream's
gradient, its op registration, and the Triton kernels under Triton's CPU interpreter against
the torch path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.interpreter import needs_triton, run_interpreted
from trainer.model.ops.group_norm_backward import group_norm_backward, launch_shape


def _case(b: int, s: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, dy, res = (torch.randn(b, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(d, generator=g, dtype=torch.float64)
    x, dy, res, w = x.to(dtype), dy.to(dtype), res.to(dtype), w.to(dtype)
    wide = torch.promote_types(dtype, torch.float32)
    rstd = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + 1e-5)
    return dy, x, rstd, w, res


def _autograd(dy, x, w, res, rows, k):
    """Each group's own norm y = rms_norm(x) w_g in fp64, differentiated by autograd: dx (plus
    the residual's gradient) and every group's weight gradient."""
    x = x.double().requires_grad_()
    leaf = w.double().expand(k, -1).clone().requires_grad_()
    y = F.rms_norm(x, (x.shape[-1],), eps=1e-5) * leaf[rows][:, None, :]
    dx, dw = torch.autograd.grad(y, (x, leaf), dy.double())
    return dx + (0 if res is None else res.double()), dw


def test_torch_path_is_the_norms_backward_with_each_groups_weight_gradient():
    """Groups 0, 0, 2 and 3 of 4 (group 1 empty: zeros), fp64: autograd's dx (with and without a
    residual gradient added) and per-group weight gradients to fp64 rounding; fp32 inputs to
    fp32's; the weight gradients in the dtype asked for."""
    rows = torch.tensor([0, 0, 2, 3])
    dy, x, rstd, w, res = _case(4, 5, 6, dtype=torch.float64)
    for r in (None, res):
        dx, dw = group_norm_backward(dy, x, rstd, w, rows, 4, torch.float64, r)
        want_dx, want_dw = _autograd(dy, x, w, r, rows, 4)
        assert dx.dtype == torch.float64 and dw.shape == (4, 6) and not dw[1].any()
        torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dw, want_dw, rtol=1e-12, atol=1e-12)
    dy, x, rstd, w, res = _case(4, 5, 6, seed=1)
    dx, dw = group_norm_backward(dy, x, rstd, w, rows, 4, torch.float32, res)
    want_dx, want_dw = _autograd(dy, x, w, res, rows, 4)
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-5)
    assert group_norm_backward(dy, x, rstd, w, rows, 4, torch.bfloat16)[1].dtype == torch.bfloat16


def test_custom_op_registration():
    dy, x, rstd, w, res = _case(3, 4, 8, seed=2)
    rows = torch.tensor([0, 1, 1])
    for r in (None, res):
        torch.library.opcheck(group_norm_backward, (dy, x, rstd, w, rows, 2, torch.float32, r))


def test_launch_shape_holds_at_most_one_tile_of_tokens_by_the_width():
    assert launch_shape(2048) == (2048, 2, 8)
    assert launch_shape(20) == (32, 128, 4)
    assert launch_shape(8192) == (8192, 1, 16)
    assert launch_shape(16384) == (16384, 1, 16)


@needs_triton
def test_triton_kernels_match_the_torch_path_in_the_interpreter():
    """Sequences that are not a multiple of the kernel's token chunk nor of its step, a chunk not a
    multiple of the step (6 tokens, 4 a step at width 16), widths that
    are not a power of two, a row count past one tile of chunks, an empty group, with and without
    the residual's gradient, fp32 and bf16 inputs, fp32 and bf16 weight gradients: dx to one
    rounding of the fp64 value (one bf16 step: the interpreter truncates; fp32 rounding of its
    terms), the weight gradients to fp32 rounding
    of the fp64 sums (bf16 outputs to one bf16 step), bitwise the same on a second call."""
    run_interpreted("""
import torch
from trainer.model.ops import group_norm_backward as nb
assert nb.triton_kernels() is not None, "triton is not importable"
g = torch.Generator().manual_seed(0)
nb.TOKENS, nb.BLOCK, nb.CHUNKS, nb.TILE = 6, 16, 2, 64
cases = ((3, 9, 20, [0, 0, 2]), (2, 4, 16, [1, 1]), (5, 17, 33, [0, 1, 1, 2, 3]), (1, 1, 5, [0]), (2, 17, 16, [0, 1]))
for b, s, d, rows in cases:
    k = max(rows) + 1
    r = torch.tensor(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x, dy, res = (torch.randn(b, s, d, generator=g).to(dtype) for _ in range(3))
        w = torch.randn(d, generator=g).to(dtype)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        for residual in (None, res):
            wide = [t if t is None else t.double() for t in (dy, x, rstd, w, residual)]
            want_dx, _ = nb.group_norm_backward_torch(*wide[:4], r, k, torch.float64, wide[4])
            gw, x_hat = (dy.double() * w.double()).abs(), x.double().abs() * rstd.double()
            terms = rstd.double() * (gw + x_hat * (gw * x_hat).mean(-1, keepdim=True))
            terms = terms + (0 if residual is None else residual.double().abs())
            for out_dtype in (torch.float32, torch.bfloat16):
                dx, dw = nb.group_norm_backward_triton(dy, x, rstd, w, r, k, out_dtype, residual)
                _, want = nb.group_norm_backward_torch(dy, x, rstd, w, r, k, torch.float64, residual)
                slack = 1e-5 * (dy.double().abs() * x.double().abs() * rstd.double()).sum((0, 1)).max() + 1e-6
                if out_dtype == torch.bfloat16:
                    slack = slack + want.abs() * 2.0**-7
                assert dw.dtype == out_dtype and dw.shape == (k, d) and dx.dtype == dtype and dx.shape == x.shape
                assert ((dw.double() - want).abs() <= slack).all(), (b, s, d, dtype, out_dtype)
                step = 2.0**-23 if dtype == torch.float32 else 2.0**-7  # the interpreter truncates to bf16
                assert ((dx.double() - want_dx).abs() <= step * want_dx.abs() + 1e-5 * terms).all(), (b, s, d, dtype)
                again = nb.group_norm_backward_triton(dy, x, rstd, w, r, k, out_dtype, residual)
                assert torch.equal(dx, again[0]) and torch.equal(dw, again[1])
print("ok")
""")
