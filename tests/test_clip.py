"""`trainer.optim.clip.squares` against float64: on bf16 views of one flat buffer like the
optimizer's main grads (torch's foreach path), and its Triton path in the interpreter."""

from __future__ import annotations

import torch

from tests.interpreter import needs_triton, run_interpreted
from trainer.optim import clip


def test_squares_match_float64_on_bf16_views():
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(3 * 64 + 40 + 7, generator=g) * 3).bfloat16()
    views = [flat[0:192].view(12, 16), flat[192:232], flat[232:239].view(7, 1)]
    want = torch.tensor([float((v.double() ** 2).sum()) for v in views], dtype=torch.float64)
    got = clip.squares(views)
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@needs_triton
def test_triton_sums_of_squares_match_float64_in_the_interpreter():
    """`trainer.optim.multi_tensor.sums_of_squares` (the CUDA path): tensors of several whole blocks and
    a partial one, exactly one block, less than one, bf16 and fp32; deterministic; a tensor at
    an unaligned address takes the foreach path."""
    run_interpreted("""
import torch
from trainer.optim import multi_tensor as mt
from trainer.optim import clip
g = torch.Generator().manual_seed(0)
B = mt.SQUARES_BLOCK
for dtype in (torch.bfloat16, torch.float32):
    ts = [(3 * torch.randn(n, generator=g)).to(dtype) for n in (2 * B + 5, 7, B, 3 * B)]
    assert mt.uses_triton_squares(ts)
    blocks = mt._squares_blocks(tuple(t.numel() for t in ts), torch.device("cpu"))
    assert blocks.whole.tensor.tolist() == [0, 0, 2, 3, 3, 3] and blocks.tails.tensor.tolist() == [0, 1]
    got = clip.squares(ts)
    want = torch.tensor([float((t.double() ** 2).sum()) for t in ts], dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(got, clip.squares(ts))
flat = torch.randn(1001, generator=g).bfloat16()
assert not mt.uses_triton_squares([flat[1:]])
torch.testing.assert_close(clip.squares([flat[1:]]).double(), (flat[1:].double() ** 2).sum()[None], rtol=1e-6, atol=0)
print("ok")
""")
