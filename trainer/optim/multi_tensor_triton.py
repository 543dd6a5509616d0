"""The Triton kernels of `trainer.optim.multi_tensor`'s ops, one program per block of one tensor
(`launch`): the AdamW update of `trainer.optim.adamw_update.adamw_update_tensors` (a block's fp32
master, as bf16 parameter and 16-bit remainder, and its moments), and the per-block then
per-tensor sums of squares of `sums_of_squares` (no atomics: deterministic). Imported only where
Triton is (trainer.model.ops.dispatch)."""

import triton
import triton.language as tl


@triton.jit
def _block(block_tensor, block_start, numels, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """This program's tensor t, its block's first element, the elements idx and their mask, as
    `trainer.optim.multi_tensor.launch` describes them (inlined where Triton compiles)."""
    t = tl.load(block_tensor + tl.program_id(0))
    start = tl.multiple_of(tl.load(block_start + tl.program_id(0)), BLOCK_SIZE)
    idx = start + tl.arange(0, BLOCK_SIZE)
    mask = idx < tl.load(numels + t) if MASKED else idx < start + BLOCK_SIZE
    return t, start, idx, mask


@triton.jit
def adamw_tensors_kernel(
    block_tensor,
    block_start,
    grad_ptrs,
    offsets,
    numels,
    remainder,
    exp_avg,
    exp_avg_sq,
    param,
    coefficients,
    n_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weights,
    n_tensors,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """ROWS = 0: tensor t's gradient at grad_ptrs[t]. ROWS > 0: it is sum_r weights[r] row_r,
    row r of tensor t at grad_ptrs[r * n_tensors + t], summed in fp32 in row order and rounded
    once to the parameters' dtype (`adamw_update_combined`: never written to memory)."""
    t, _, idx, mask = _block(block_tensor, block_start, numels, BLOCK_SIZE, MASKED)
    flat = tl.multiple_of(tl.load(offsets + t), ALIGN) + idx
    step_size = tl.load(coefficients)
    bias_correction2_sqrt = tl.load(coefficients + 1)
    keep = tl.load(coefficients + 2)
    if ROWS == 0:
        grad = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(param.dtype.element_ty)), 16)
        g = tl.load(grad + idx, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
        for r in tl.static_range(ROWS):
            row = tl.multiple_of(tl.load(grad_ptrs + r * n_tensors + t).to(tl.pointer_type(param.dtype.element_ty)), 16)
            acc += tl.load(weights + r).to(tl.float32) * tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
        g = acc.to(param.dtype.element_ty).to(tl.float32)
    g = g * tl.load(coefficients + 3)
    m = tl.load(exp_avg + flat, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + flat, mask=mask, other=0.0)
    low = tl.load(remainder + flat, mask=mask, other=0)
    high = tl.load(param + flat, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) - (low < 0)
    w = ((high << 16) | (low.to(tl.int32) & 0xFFFF)).to(tl.float32, bitcast=True)  # join_fp32
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    w = w * tl.where(flat < n_decay, keep, 1.0) - tl.div_rn(step_size * m, denom)
    tl.store(exp_avg + flat, m, mask=mask)
    tl.store(exp_avg_sq + flat, v, mask=mask)
    bits = w.to(tl.int32, bitcast=True)  # split_fp32
    low = bits & 0xFFFF
    tl.store(remainder + flat, ((low ^ 0x8000) - 0x8000).to(tl.int16), mask=mask)
    tl.store(param + flat, ((bits >> 16) + (low >> 15)).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def block_squares_kernel(
    block_tensor,
    block_start,
    ptrs,
    numels,
    first_block,
    partials,
    DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    t, start, idx, mask = _block(block_tensor, block_start, numels, BLOCK_SIZE, MASKED)
    x = tl.multiple_of(tl.load(ptrs + t).to(tl.pointer_type(DTYPE)), 16)
    x = tl.load(x + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(partials + tl.load(first_block + t) + start // BLOCK_SIZE, tl.sum(x * x, axis=0))


@triton.jit
def tensor_sums_kernel(partials, first_block, out, CHUNK: tl.constexpr):
    t = tl.program_id(0)
    lo = tl.load(first_block + t)
    hi = tl.load(first_block + t + 1)
    acc = tl.zeros([CHUNK], tl.float32)
    for at in range(lo, hi, CHUNK):
        i = at + tl.arange(0, CHUNK)
        acc += tl.load(partials + i, mask=i < hi, other=0.0)
    tl.store(out + t, tl.sum(acc, axis=0))
