"""`trainer.parallel.clip.squares` against float64: on bf16 views of one flat buffer like the
optimizer's main grads (torch's foreach path), and its Triton path in the interpreter."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
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


def test_triton_sums_of_squares_match_float64_in_the_interpreter():
    """`trainer.multi_tensor.sums_of_squares` (the CUDA path): tensors of several blocks and a
    ragged last one, one smaller than a block, bf16 and fp32; deterministic."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    script = textwrap.dedent("""
        import torch
        from trainer import multi_tensor as mt
        from trainer.parallel import clip
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            ts = [(3 * torch.randn(n, generator=g)).to(dtype) for n in (2 * mt.SQUARES_BLOCK + 5, 7, mt.SQUARES_BLOCK)]
            assert mt.uses_triton_squares(ts)
            got = clip.squares(ts)
            want = torch.tensor([float((t.double() ** 2).sum()) for t in ts], dtype=torch.float64)
            assert got.dtype == torch.float32 and got.shape == (3,)
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
            assert torch.equal(got, clip.squares(ts))
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
