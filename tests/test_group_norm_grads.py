"""DoGE's per-group RMSNorm weight gradients (trainer/model/ops/group_norm_grads.py): the torch
path against a float64 formula and its op registration, and the Triton kernels under Triton's
CPU interpreter against the torch path."""

from __future__ import annotations

import torch

from tests.interpreter import needs_triton, run_interpreted
from trainer.model.ops.group_norm_grads import group_norm_weight_grads, group_norm_weight_grads_torch


def _case(b: int, s: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=g)
    dy = torch.randn(b, s, d, generator=g)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return dy, x, rstd


def test_torch_path_sums_dy_times_the_normalised_input_over_each_groups_tokens():
    """Groups 0, 0, 2 and 3 of 4 (group 1 empty: zeros): out[g] = sum over g's rows and tokens of
    dy x rstd, to fp32 rounding of the fp64 sum, in the dtype asked for."""
    dy, x, rstd = _case(4, 5, 6)
    rows = torch.tensor([0, 0, 2, 3])
    out = group_norm_weight_grads(dy, x, rstd, rows, 4, torch.float32)
    prod = (dy.double() * x.double() * rstd.double()).sum(1)
    want = torch.stack([prod[rows == g].sum(0) for g in range(4)])
    assert out.shape == (4, 6) and out.dtype == torch.float32 and not out[1].any()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert group_norm_weight_grads(dy, x, rstd, rows, 4, torch.bfloat16).dtype == torch.bfloat16
    exact = group_norm_weight_grads_torch(dy.double(), x.double(), rstd.double(), rows, 4, torch.float64)
    torch.testing.assert_close(exact, want, rtol=1e-12, atol=1e-12)


def test_custom_op_registration():
    dy, x, rstd = _case(3, 4, 8, seed=1)
    torch.library.opcheck(group_norm_weight_grads, (dy, x, rstd, torch.tensor([0, 1, 1]), 2, torch.float32))


@needs_triton
def test_triton_kernels_match_the_torch_path_in_the_interpreter():
    """Sequences that are not a multiple of the kernel's token tile, columns that are not a
    multiple of its block, a row count past one tile of chunks, an empty group, fp32 and bf16
    inputs, fp32 and bf16 outputs: the torch path's sums to fp32 rounding (bf16 outputs to one
    bf16 step), bitwise the same on a second call."""
    run_interpreted("""
import torch
from trainer.model.ops import group_norm_grads as ng
assert ng.triton_kernels() is not None, "triton is not importable"
g = torch.Generator().manual_seed(0)
ng.TOKENS, ng.BLOCK, ng.CHUNKS = 4, 16, 2
for b, s, d, rows in ((3, 9, 20, [0, 0, 2]), (2, 4, 16, [1, 1]), (5, 17, 33, [0, 1, 1, 2, 3]), (1, 1, 5, [0])):
    k = max(rows) + 1
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(b, s, d, generator=g).to(dtype)
        dy = torch.randn(b, s, d, generator=g).to(dtype)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        r = torch.tensor(rows)
        for out_dtype in (torch.float32, torch.bfloat16):
            got = ng.group_norm_weight_grads_triton(dy, x, rstd, r, k, out_dtype)
            want = ng.group_norm_weight_grads_torch(dy, x, rstd, r, k, torch.float64)
            slack = 1e-5 * (dy.double().abs() * x.double().abs() * rstd.double()).sum((0, 1)).max() + 1e-6
            if out_dtype == torch.bfloat16:
                slack = slack + want.abs() * 2.0**-7
            assert got.dtype == out_dtype and got.shape == (k, d)
            assert ((got.double() - want).abs() <= slack).all(), (b, s, d, dtype, out_dtype)
            assert torch.equal(got, ng.group_norm_weight_grads_triton(dy, x, rstd, r, k, out_dtype))
print("ok")
""")
