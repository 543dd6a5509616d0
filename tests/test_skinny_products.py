"""The skinny-product kernel (trainer/model/ops/skinny_products_triton.py: `skinny_products`,
`summed_gram`, `weighted_rows`), run by Triton's CPU interpreter (TRITON_INTERPRET=1, its `tl.dot`
made a GPU's by tests.interpreter `faithful_dot`) against a float64 reference, and DoGE's
`rows_gram` / `rows_dot` / `group_gram` (trainer/run/alignment.py), which take it on CUDA only:
on the CPU they give bitwise what their torch paths gave before the kernel."""

from __future__ import annotations

import textwrap

import pytest
import torch

import trainer.run.alignment as alignment
from tests.interpreter import needs_triton, run_interpreted


@needs_triton
def test_kernel_matches_float64_reference_is_repeatable_and_symmetric_in_the_interpreter():
    """The tensor-core kernel under the interpreter, its `tl.dot` made a GPU's (tests.interpreter
    `faithful_dot`: bf16 by value, fp32 rounded to tf32 unless "ieee"): r in {1, 3, 5, 8, 13, 16},
    s in {1, r}, n around a (small, overridden) column block and 0, fp32 and bf16 inputs: within
    fp32-accumulation rounding of the fp64 sum of the inputs' own values (1e-5 of sum |x_ic
    y_jc|), bitwise the same on a second call, a Gram (y is x, or a view of x's elements) bitwise
    symmetric. fp32 inputs whose tf32 rounding would be 2^-12 off (x = t (1 + 2^-12), t a tf32
    value) are exact to the bound. Then the default tile, fp16, mixed dtypes, strided rows and
    columns, `summed_gram` (the sum of per-tensor Grams, in fp64, repeatable, symmetric; also
    through `group_gram` with the device check lifted) and the refusals."""
    script = textwrap.dedent("""
        import torch
        from tests.interpreter import faithful_dot
        from trainer.model.ops import skinny_products_triton as sk
        from trainer.run import alignment
        faithful_dot()
        assert alignment._skinny_kernels() is not None, "triton is not importable"
        g = torch.Generator().manual_seed(0)

        def within(out, want, bound, what):
            err = (out.double() - want).abs()
            assert (err <= bound).all(), (what, (err - bound).max().item())

        def check(x, y, **tile):
            out = sk.skinny_products(x, y, **tile)
            assert out.dtype == torch.float32 and out.shape == (x.shape[0], y.shape[0]), out.shape
            xd, yd = x.double(), y.double()
            within(out, xd @ yd.t(), 1e-5 * (xd.abs() @ yd.abs().t()), (x.shape, y.shape, x.dtype, y.dtype))
            assert torch.equal(out, sk.skinny_products(x, y, **tile)), "not repeatable"
            if y is x:
                assert torch.equal(out, out.t()), "Gram not symmetric"
            return out

        BLOCK, SUB = 128, 32
        for r in (1, 3, 5, 8, 13, 16):
            for s in sorted({1, r}):
                for n in (0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 7):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.randn(r, n, generator=g).to(dtype)
                        y = x if s == r else torch.randn(s, n, generator=g).to(dtype)
                        out = check(x, y, block=BLOCK, sub=SUB)
                        if n == 0:
                            assert not out.any()
        x = torch.randn(3, 300, generator=g)
        check(x, torch.randn(16, 300, generator=g), block=BLOCK, sub=SUB)
        view = sk.skinny_products(x, x.view(3, 300), block=BLOCK, sub=SUB)
        assert torch.equal(view, view.t()), "a view of x's elements is a Gram"

        # fp32 exact, not tf32: t has 11 significant bits, x = t (1 + 2^-12) 24 (exact in fp32);
        # tf32 (rounded or truncated) takes x to t, 2^-11 off in every x_ic^2.
        t = torch.randn(6, 3 * BLOCK + 7, generator=g)
        t = (t.view(torch.int32) & ~0x1FFF).view(torch.float32)
        x = t * (1 + 2.0**-12)
        xd, td = x.double(), t.double()
        assert not ((td @ td.t() - xd @ xd.t()).abs() <= 1e-5 * (xd.abs() @ xd.abs().t())).all()
        check(x, x, block=BLOCK, sub=SUB)
        check(x, x[:2].clone(), block=BLOCK, sub=SUB)

        # a Gram's result is its upper triangle mirrored (the interpreter's dot is symmetric, a
        # GPU's need not be): partial sums spoilt below the diagonal change nothing
        launch = sk._launch

        def skewed(x, y, same, partials, base, block, sub, *launch_choices):
            launch(x, y, same, partials, base, block, sub, *launch_choices)
            partials.add_(torch.ones_like(partials).tril(-1))

        x = torch.randn(4, 3 * BLOCK + 7, generator=g).bfloat16()
        want = sk.skinny_products(x, x, block=BLOCK, sub=SUB)
        sk._launch = skewed
        assert torch.equal(sk.skinny_products(x, x, block=BLOCK, sub=SUB), want)
        spoilt = sk.summed_gram([x, x[:, :5]], block=BLOCK, sub=SUB)
        sk._launch = launch
        assert torch.equal(spoilt, sk.summed_gram([x, x[:, :5]], block=BLOCK, sub=SUB))

        # a loop step packs chunks(r, s) chunks of sub columns: 16 for one row, 3 for DoGE's 5
        assert (sk.chunks(1, 1), sk.chunks(5, 5), sk.chunks(5, 1), sk.chunks(9, 9), sk.chunks(16, 1)) == (16, 3, 3, 1, 1)
        step = 16 * sk.SUB
        assert sk.tile(1) == sk.tile(step) == (step, sk.SUB)
        assert sk.tile(step * sk.MAX_PROGRAMS) == (step, sk.SUB)
        assert sk.tile(step * sk.MAX_PROGRAMS + 1) == (2 * step, sk.SUB)
        for n in (2048, 4 * 2048 * 2048, 32000 * 2048):
            block, sub = sk.tile(n, 5, 5)
            step = 3 * sub
            fewest = block == step or -(-n // (block - step)) > sk.MAX_PROGRAMS
            assert block % step == 0 and -(-n // block) <= sk.MAX_PROGRAMS and fewest, (n, block)
        for bad in ({"sub": 8}, {"sub": 48}, {"block": 100, "sub": 32}):
            try:
                sk.tile(1000, **bad)
            except ValueError as e:
                assert "power of two >= 16" in str(e), e
            else:
                raise AssertionError(bad)
        for r, s in ((5, 5), (5, 1)):
            x = torch.randn(r, 3 * sk.SUB + 7, generator=g).bfloat16()
            check(x, x if s == r else torch.randn(s, x.shape[1], generator=g).bfloat16())
        x = torch.randn(3, 300, generator=g).half()
        check(x, x, block=BLOCK, sub=SUB)
        check(x, torch.randn(1, 300, generator=g), block=BLOCK, sub=SUB)  # fp16 rows, an fp32 vector
        check(x, torch.randn(2, 300, generator=g).bfloat16(), block=BLOCK, sub=SUB)  # fp16 and bf16
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

        # summed_gram: the Grams of tensors [r, n_t] summed in fp64 from one buffer
        for r in (1, 5, 16):
            xs = [torch.randn(r, n, generator=g).to(dtype) for n, dtype in (
                (0, torch.bfloat16), (1, torch.bfloat16), (BLOCK + 5, torch.float32), (3 * BLOCK + 7, torch.bfloat16),
                (200, torch.float16))]
            wide = torch.randn(r, 316, generator=g).bfloat16()
            xs.append(wide[:, 8:-8])  # strided rows
            out = sk.summed_gram(xs, block=BLOCK, sub=SUB)
            assert out.dtype == torch.float64 and out.shape == (r, r)
            want = sum(x.double() @ x.double().t() for x in xs)
            bound = 1e-5 * sum(x.double().abs() @ x.double().abs().t() for x in xs)
            within(out, want, bound, ("summed_gram", r))
            each = sum(sk.skinny_products(x, x, block=BLOCK, sub=SUB).double() for x in xs)
            within(out, each, bound, ("summed_gram vs per-tensor", r))
            assert torch.equal(out, sk.summed_gram(xs, block=BLOCK, sub=SUB)), "not repeatable"
            assert torch.equal(out, out.t()), "summed Gram not symmetric"
            # the bench's launch choices (doge_kernels_bench.py): at most 2 programs a tensor
            fewer = sk.summed_gram(xs, sub=SUB, warps=8, stages=2, programs=2)
            within(fewer, want, bound, ("summed_gram, 2 programs", r))
        # a tuned launch that fails leaves the fixed one, said once: the same numbers
        x = torch.randn(5, 3 * BLOCK + 7, generator=g).bfloat16()
        want = sk.summed_gram([x], block=BLOCK, sub=SUB)

        class Broken:
            def __getitem__(self, grid):
                raise RuntimeError("no such launch")

        sk._interpreted, sk.tuned_kernel = (lambda: False), (lambda: Broken())
        import warnings
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert torch.equal(sk.summed_gram([x], block=BLOCK, sub=SUB), want)
            assert torch.equal(sk.summed_gram([x], block=BLOCK, sub=SUB), want)
        assert sk.TUNING_FAILED == ["RuntimeError: no such launch"] and len(said) == 1, (sk.TUNING_FAILED, said)
        assert sk.tile(10 * SUB, 16, 16, sub=SUB, programs=2) == (5 * SUB, SUB)
        assert sk.tile(10 * SUB, 5, 5, sub=SUB, programs=2) == (6 * SUB, SUB)
        assert torch.equal(sk.summed_gram([torch.zeros(3, 0), torch.zeros(3, 0)]), torch.zeros(3, 3, dtype=torch.float64))
        for bad in ([], [torch.zeros(3, 4), torch.zeros(2, 4)], [torch.zeros(17, 4)]):
            try:
                sk.summed_gram(bad)
            except ValueError:
                pass
            else:
                raise AssertionError([t.shape for t in bad])

        # group_gram through summed_gram (the device check lifted): the CPU path's numbers
        grads = [torch.randn(5, 20, 30, generator=g).bfloat16(), torch.randn(5, 7, generator=g).bfloat16(),
                 torch.randn(5, 3, 100, generator=g).bfloat16()]
        cpu = alignment.group_gram(grads, [True, False, True], here=True)
        alignment._triton_kernel = lambda op, rows, *ts: alignment._skinny_kernels()[op]
        gram = alignment.group_gram(grads, [True, False, True], here=True)
        bound = 1e-5 * sum(x.double().reshape(5, -1).abs() @ x.double().reshape(5, -1).abs().t() for x in grads)
        within(gram, cpu, bound, "group_gram")
        assert gram.dtype == torch.float64 and torch.equal(gram, gram.t()) and not torch.equal(gram, cpu)

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
        low = w.bfloat16()  # bf16 weights are upcast in the kernel: bitwise their fp32 values' result
        assert torch.equal(sk.weighted_rows(low, rows, block=BLOCK), sk.weighted_rows(low.float(), rows, block=BLOCK))
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
        params = [grads, torch.randn(r, 7, generator=g).to(dtype), torch.randn(r, 3, 50, generator=g).to(dtype)]
        assert torch.equal(alignment.group_gram(params, [True, False, True], here=True), _group_gram_before(params))


def _group_gram_before(grads: list[torch.Tensor]) -> torch.Tensor:
    """`group_gram` on the CPU before `summed_gram` (counted: the first and the last)."""
    r = grads[0].shape[0]
    out = torch.zeros(r, r, dtype=torch.float64)
    for g in (grads[0], grads[-1]):
        out += _gram_before(g.reshape(r, -1)).to(torch.float64)
    return out


def test_a_kernel_that_fails_on_cuda_leaves_the_torch_paths_and_says_so_once(monkeypatch):
    """A kernel Triton cannot build on the machine (stood in by one that raises) is tried once:
    `_triton_products` warns with the reason and returns None, so `rows_gram` / `rows_dot` take
    their torch GEMMs, and it is not called again in the process."""
    calls = []

    def broken(x, y):
        calls.append(1)
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(alignment, "_skinny_kernels", lambda: (broken, broken, broken, 16, (torch.bfloat16,)))
    monkeypatch.setattr(alignment, "_TRITON_PRODUCTS_FAILED", [])
    fake = type("Cuda", (), {"device": torch.device("cuda"), "shape": (5, 7), "dtype": torch.bfloat16})()
    with pytest.warns(UserWarning, match=r"skinny-product Triton kernel failed \(RuntimeError: PTX compile failed\)"):
        assert alignment._triton_products(fake, fake) is None
    assert alignment._triton_products(fake, fake) is None
    assert calls == [1] and alignment._TRITON_PRODUCTS_FAILED == ["RuntimeError: PTX compile failed"]


def test_group_gram_takes_one_summed_gram_call_and_falls_back_to_rows_gram(monkeypatch):
    """Where the kernels apply (stood in on the CPU), `group_gram` hands the counted parameters'
    [r, n] views to `summed_gram` (op 2) in one call and returns its fp64 Gram as it is; a
    `summed_gram` that fails warns once and leaves the per-parameter `rows_gram` sum, bitwise the
    CPU path's."""
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(4, 6, 5, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 9, generator=g)]
    cpu = alignment.group_gram(grads, [True, False, True], here=True)
    seen = []

    def summed(flats):
        seen.append([tuple(f.shape) for f in flats])
        return torch.full((4, 4), 7.0, dtype=torch.float64)

    monkeypatch.setattr(alignment, "_TRITON_PRODUCTS_FAILED", [])
    monkeypatch.setattr(alignment, "_triton_kernel", lambda op, rows, *ts: summed if op == 2 and rows == 4 else None)
    assert torch.equal(alignment.group_gram(grads, [True, False, True], here=True), torch.full((4, 4), 7.0).double())
    assert seen == [[(4, 30), (4, 9)]]
    assert not alignment.group_gram(grads, [False, False, False], here=True).any() and len(seen) == 1

    def broken(flats):
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(alignment, "_triton_kernel", lambda op, rows, *ts: broken if op == 2 else None)
    with pytest.warns(UserWarning, match=r"skinny-product Triton kernel failed"):
        assert torch.equal(alignment.group_gram(grads, [True, False, True], here=True), cpu)
    assert alignment._TRITON_PRODUCTS_FAILED == ["RuntimeError: PTX compile failed"]
