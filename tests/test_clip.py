"""`trainer.parallel.clip.squares` against float64, on bf16 views of one flat buffer like the
optimizer's main grads."""

from __future__ import annotations

import torch

from trainer.parallel import clip


def test_squares_match_float64_on_bf16_views():
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(3 * 64 + 40 + 7, generator=g) * 3).bfloat16()
    views = [flat[0:192].view(12, 16), flat[192:232], flat[232:239].view(7, 1)]
    want = torch.tensor([float((v.double() ** 2).sum()) for v in views], dtype=torch.float64)
    got = clip.squares(views)
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
