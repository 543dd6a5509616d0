"""The skinny-product kernel (trainer/model/ops/skinny_products_triton.py), run by Triton's CPU
interpreter (TRITON_INTERPRET=1) against a float64 reference, and DoGE's `rows_gram` / `rows_dot`
(trainer/run/alignment.py), which take it on CUDA only: on the CPU they give bitwise what their
torch paths gave before the kernel."""

from __future__ import annotations

import textwrap

import pytest
import torch

import trainer.run.alignment as alignment
from tests.interpreter import needs_triton, run_interpreted


@needs_triton
def test_kernel_matches_float64_reference_is_repeatable_and_symmetric_in_the_interpreter():
    """r in {1, 3, 5, 8}, s in {1, r}, n around a (small, overridden) column block and 0, fp32 and
    bf16 inputs: within fp32-accumulation rounding of the fp64 sum of the inputs' own values
    (1e-5 of sum |x_ic y_jc|), bitwise the same on a second call, a Gram (y is x) bitwise
    symmetric. Then the default tile, fp16, mixed dtypes, strided rows, and the refusals."""
    script = textwrap.dedent("""
        import torch
        from trainer.model.ops import skinny_products_triton as sk
        from trainer.run import alignment
        assert alignment._skinny_kernels() is not None, "triton is not importable"
        g = torch.Generator().manual_seed(0)

        def check(x, y, **tile):
            out = sk.skinny_products(x, y, **tile)
            assert out.dtype == torch.float32 and out.shape == (x.shape[0], y.shape[0]), out.shape
            xd, yd = x.double(), y.double()
            err = (out.double() - xd @ yd.t()).abs()
            bound = 1e-5 * (xd.abs() @ yd.abs().t())
            assert (err <= bound).all(), (x.shape, y.shape, x.dtype, (err - bound).max().item())
            assert torch.equal(out, sk.skinny_products(x, y, **tile)), "not repeatable"
            if y is x:
                assert torch.equal(out, out.t()), "Gram not symmetric"
            return out

        BLOCK, SUB = 128, 32
        for r in (1, 3, 5, 8, 13):
            for s in sorted({1, r}):
                for n in (0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 7):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.randn(r, n, generator=g).to(dtype)
                        y = x if s == r else torch.randn(s, n, generator=g).to(dtype)
                        out = check(x, y, block=BLOCK, sub=SUB)
                        if n == 0:
                            assert not out.any()
        for r, s in ((5, 5), (5, 1), (1, 1)):
            block, _ = sk.tile(r, s)
            x = torch.randn(r, 3 * block + 7, generator=g).bfloat16()
            check(x, x if s == r else torch.randn(s, x.shape[1], generator=g).bfloat16())
        x = torch.randn(3, 300, generator=g).half()
        check(x, x, block=BLOCK, sub=SUB)
        check(x, torch.randn(1, 300, generator=g), block=BLOCK, sub=SUB)  # fp16 rows, an fp32 vector
        wide = torch.randn(4, 300 + 16, generator=g).bfloat16()
        check(wide[:, 8:-8], wide[:2, 8:-8], block=BLOCK, sub=SUB)  # rows 300 long, row stride 316
        check(wide.t().contiguous().t()[:, :300], wide[:1, :300], block=BLOCK, sub=SUB)  # columns strided
        for bad, err in (((17, 1), ValueError), ((1, 17), ValueError), ((0, 1), ValueError)):
            try:
                sk.skinny_products(torch.zeros(bad[0], 4), torch.zeros(bad[1], 4))
            except err as e:
                assert "rows must be 1 to 16" in str(e), e
            else:
                raise AssertionError(bad)
        try:
            sk.skinny_products(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(1, 4))
        except TypeError:
            pass
        else:
            raise AssertionError("float64 accepted")
        # weighted_rows: sum_i w_i x_i in fp32, rounded once to x's dtype
        for r in (1, 4, 13):
            for n in (0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 5):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(r, n, generator=g).to(dtype)
                    w = torch.randn(r, generator=g)
                    out = sk.weighted_rows(w, x, block=BLOCK)
                    assert out.dtype == dtype and out.shape == (n,)
                    want = (w.double()[:, None] * x.double()).sum(0)
                    slack = 1e-5 * (w.double().abs()[:, None] * x.double().abs()).sum(0)
                    if dtype == torch.bfloat16:  # one rounding of the fp32 sum to bf16 (the
                        # interpreter casts toward zero, a GPU to nearest: one bf16 ulp either way)
                        slack = slack + want.abs() * 2.0**-7
                    assert ((out.double() - want).abs() <= slack).all(), (r, n, dtype)
                    assert torch.equal(out, sk.weighted_rows(w, x, block=BLOCK)), "not repeatable"
        wide = torch.randn(4, 300 + 16, generator=g).bfloat16()
        rows = wide[:, 8:-8]  # rows 300 long, row stride 316
        w = torch.randn(4, generator=g)
        want = (w.double()[:, None] * rows.double()).sum(0)
        assert ((sk.weighted_rows(w, rows, block=BLOCK).double() - want).abs() <= want.abs() * 2.0**-7 + 1e-4).all()
        for bad in ((torch.zeros(2), torch.zeros(3, 4)), (torch.zeros(65), torch.zeros(65, 4))):
            try:
                sk.weighted_rows(*bad)
            except ValueError as e:
                assert "weighted_rows: expected x [r, n]" in str(e), e
            else:
                raise AssertionError([t.shape for t in bad])
        print("ok")
    """)
    run_interpreted(script)


def _gram_before(flat: torch.Tensor) -> torch.Tensor:
    """`rows_gram` on the CPU before the kernel (its fp32 GEMM, else the chunked upcast)."""
    if flat.dtype == torch.float32:
        return torch.mm(flat, flat.t())
    out = torch.zeros(flat.shape[0], flat.shape[0], dtype=torch.float32)
    for gc in flat.split(max(1, alignment._DOT_CHUNK // flat.shape[0]), dim=1):
        gc = gc.float()
        out += torch.mm(gc, gc.t())
    return out


def _dot_before(flat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """`rows_dot` on the CPU before the kernel (its fp32 GEMV, else the chunked upcast)."""
    if flat.dtype == torch.float32 and vec.dtype == torch.float32:
        return torch.mv(flat, vec)
    out = torch.zeros(flat.shape[0], dtype=torch.float32)
    step = max(1, alignment._DOT_CHUNK // flat.shape[0])
    for gc, tc in zip(flat.split(step, dim=1), vec.split(step)):
        out += torch.mv(gc.float(), tc.float())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_gram_and_rows_dot_on_the_cpu_are_unchanged(monkeypatch, dtype):
    """On the CPU the Triton kernels are never asked for, and the numbers are bitwise the torch
    paths' (chunks made small so that the chunked upcast takes several; `combine` one GEMV)."""

    def no_triton():
        raise AssertionError("the Triton kernel was asked for on the CPU")

    monkeypatch.setattr(alignment, "_skinny_kernels", no_triton)
    monkeypatch.setattr(alignment, "_DOT_CHUNK", 64)
    g = torch.Generator().manual_seed(3)
    for r in (1, 5, 9):
        flat = torch.randn(r, 1000, generator=g).to(dtype)
        vec = torch.randn(1000, generator=g).to(dtype)
        assert torch.equal(alignment.rows_gram(flat), _gram_before(flat))
        assert torch.equal(alignment.rows_dot(flat, vec), _dot_before(flat, vec))
        scale = torch.randn(r, generator=g, dtype=torch.float64)
        grads = flat.view(r, 10, 100)
        want = torch.mv(flat.t(), scale.to(dtype)).view(10, 100)
        assert torch.equal(alignment.combine(scale, grads), want)


def test_a_kernel_that_fails_on_cuda_leaves_the_torch_paths_and_says_so_once(monkeypatch):
    """A kernel Triton cannot build on the machine (stood in by one that raises) is tried once:
    `_triton_products` warns with the reason and returns None, so `rows_gram` / `rows_dot` take
    their torch GEMMs, and it is not called again in the process."""
    calls = []

    def broken(x, y):
        calls.append(1)
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(alignment, "_skinny_kernels", lambda: (broken, broken, 16, (torch.bfloat16,)))
    monkeypatch.setattr(alignment, "_TRITON_PRODUCTS_FAILED", [])
    fake = type("Cuda", (), {"device": torch.device("cuda"), "shape": (5, 7), "dtype": torch.bfloat16})()
    with pytest.warns(UserWarning, match=r"skinny-product Triton kernel failed \(RuntimeError: PTX compile failed\)"):
        assert alignment._triton_products(fake, fake) is None
    assert alignment._triton_products(fake, fake) is None
    assert calls == [1] and alignment._TRITON_PRODUCTS_FAILED == ["RuntimeError: PTX compile failed"]
