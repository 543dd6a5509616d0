"""The Triton program of `trainer.model.ops.swiglu`'s backward: one row block of gate, up and the
incoming gradient read once, both halves of the input gradient written, in fp32 registers.
Imported only by `swiglu.triton_kernel`, on first use (Triton is optional)."""

import triton
import triton.language as tl


@triton.jit
def swiglu_backward_kernel(
    g_ptr, gu_ptr, out_ptr, f, g_row_stride, gu_row_stride, out_row_stride, BLOCK_SIZE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < f
    gate = tl.load(gu_ptr + row * gu_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_row_stride + f + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_up = g * gate * sig
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    out = out_ptr + row * out_row_stride
    tl.store(out + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + f + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)
