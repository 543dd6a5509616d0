"""The fused SwiGLU's backward: the torch path against autograd, the Triton kernel (run by
Triton's CPU interpreter, TRITON_INTERPRET=1) against a float64 reference, the custom op's
registration (schema, fake tensor) through torch.library.opcheck."""

from __future__ import annotations

import textwrap

import torch
import torch.nn.functional as F

from tests.interpreter import needs_triton, run_interpreted
from trainer.model.ops.swiglu import swiglu, swiglu_backward, swiglu_backward_torch


def _reference_grad(g: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    x = gate_up.detach().double().requires_grad_()
    gate, up = x.chunk(2, -1)
    (F.silu(gate) * up).backward(g.double())
    return x.grad


def test_torch_backward_equals_autograd_in_float64():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 3, 2 * 7, generator=g, dtype=torch.float64)
    grad = torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        swiglu_backward_torch(grad, gate_up), _reference_grad(grad, gate_up), rtol=1e-12, atol=1e-12
    )


def test_custom_op_registration_and_module_gradient():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 2 * 6, generator=g, requires_grad=True)
    grad = torch.randn(4, 6, generator=g)
    torch.library.opcheck(swiglu_backward, (grad, gate_up.detach()))
    (swiglu(gate_up) * grad).sum().backward()
    torch.testing.assert_close(gate_up.grad.double(), _reference_grad(grad, gate_up), rtol=1e-6, atol=1e-6)


@needs_triton
def test_triton_kernel_matches_float64_reference_in_the_interpreter():
    """Row blocks that do not divide f, a single column, a strided (sliced) input, fp32 and bf16."""
    script = textwrap.dedent("""
        import torch
        from trainer.model.ops import swiglu as sw
        assert sw.triton_kernel() is not None, "triton is not importable"
        g = torch.Generator().manual_seed(0)
        cases = [((3, 2), sw.BLOCK + 37), ((5,), 64), ((2, 2), 1)]
        for shape, f in cases:
            for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
                gu = torch.randn(*shape, 2 * f, generator=g).to(dtype)
                gg = torch.randn(*shape, f, generator=g).to(dtype)
                out = sw.swiglu_backward_triton(gg, gu)
                ref = sw.swiglu_backward_torch(gg.double(), gu.double())
                assert out.dtype == dtype and out.shape == gu.shape
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < tol, (shape, f, dtype, err)
        wide = torch.randn(4, 2 * 40 + 8, generator=g)
        gu = wide[:, 4:-4]  # rows of 80 columns with a row stride of 88
        gg = torch.randn(4, 40, generator=g)
        out = sw.swiglu_backward_triton(gg, gu)
        ref = sw.swiglu_backward_torch(gg.double(), gu.double())
        assert ((out.double() - ref).abs().max()).item() < 1e-6
        print("ok")
    """)
    run_interpreted(script)
