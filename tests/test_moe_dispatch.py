"""The MoE block's dispatch at speed (issue 37 item 3; trainer/model/moe.py, trainer/parallel/expert.py).

- The grouped-GEMM probe passes where `torch._grouped_mm` runs forward and backward (it gave
  the kernel a broadcast gradient, which the kernel refuses, and so answered False everywhere:
  the GPU ran the loop over slices), also when first asked under `no_grad`, `inference_mode`,
  autocast or while dynamo traces (its answer is cached: asked under `no_grad` it answered
  False for the process, and the H100's eager layer took the loop).
- fp32 expert weights under bf16 autocast reach the grouped kernel in bf16, exactly as bf16
  copies would, their gradients those copies' upcast.
- The bench reports the GEMMs each layer variant called (profiled), eager and compiled, in pairs.
- The padded grouped layout by hand; the grouped path (forced on the CPU, whose `_grouped_mm`
  kernel exists) equals the loop over slices, forward and gradients, bit for bit.
- The gathers that replace indexing (sort, replicate, unpermute) equal the old indexing path
  forward and backward, and the per-sequence counts' scatter equals the old loop over sequences.
- The block on the grouped path compiles as one graph with no break (`aot_eager`, fullgraph),
  gives eager's numbers, and records its statistics once per training forward, also when a
  checkpoint recomputes the compiled block in backward.
"""

from __future__ import annotations

import pytest
import torch

import trainer.model.moe as moe_module
from trainer.config.moe import MoEConfig
from trainer.config.schema import ModelConfig
from trainer.model.moe import (
    MoE,
    _grouped_mm_runs,
    _ReplicateRows,
    grouped_swiglu,
    padded_groups,
    sequence_balance_terms,
    sort_assignments,
)
from trainer.parallel.expert import permute_rows
from trainer.parallel.tensor import TensorParallel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def grouped(monkeypatch):
    """The grouped-GEMM path on the CPU (torch's CPU `_grouped_mm`, any group size)."""
    monkeypatch.setattr(moe_module, "_grouped_mm_applies", lambda x, gate_up, down: True)


def test_grouped_mm_probe_passes_where_the_kernel_runs():
    assert _grouped_mm_runs(torch.device("cpu")) is True


def test_padded_groups_by_hand():
    offs, slot, source = padded_groups(torch.tensor([5, 0, 9, 8]), 22)
    # P = 22 + 4 x 8 = 54 -> 56 rows; groups of 8, 8 (empty: all pad), 16, 24 (the remainder).
    assert offs.tolist() == [8, 16, 32, 56] and offs.dtype == torch.int32
    assert slot.tolist() == [0, 1, 2, 3, 4] + list(range(16, 25)) + list(range(32, 40))
    want = [22] * 56
    for row, s in enumerate(slot.tolist()):
        want[s] = row
    assert source.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_equals_the_loop_over_slices(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(22, 16, generator=gen).to(dtype).requires_grad_()
    gate_up = torch.randn(4, 32, 16, generator=gen).to(dtype).requires_grad_()
    down = torch.randn(4, 16, 16, generator=gen).to(dtype).requires_grad_()
    counts, g = torch.tensor([5, 0, 9, 8]), torch.randn(22, 16, generator=gen).to(dtype)

    def run():
        y = grouped_swiglu(x, gate_up, down, counts)
        y.backward(g)
        out = [y.detach()] + [t.grad.clone() for t in (x, gate_up, down)]
        x.grad = gate_up.grad = down.grad = None
        return out

    loop = run()
    monkeypatch.setattr(moe_module, "_grouped_mm_applies", lambda *a: True)
    for a, b in zip(run(), loop):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dispatch_gathers_equal_the_indexing_path(k):
    """Integer-valued tensors: every sum exact in any order, so equality is the test."""
    gen = torch.Generator().manual_seed(k)
    t, d, e = 11, 4, 5
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    x = torch.randint(-4, 5, (t, d), generator=gen).float().requires_grad_()
    g = torch.randint(-4, 5, (t * k, d), generator=gen).float()
    route = sort_assignments(experts, e)
    order = torch.argsort(experts.reshape(-1), stable=True)
    assert torch.equal(route.order, order)
    assert torch.equal(route.counts, torch.bincount(experts.reshape(-1), minlength=e))
    assert torch.equal(route.order[route.inverse], torch.arange(t * k))

    new = _ReplicateRows.apply(x, route.order, route.inverse, k)
    unsorted_new = permute_rows(new * 3, route.inverse, route.order)
    unsorted_new.backward(g)
    grad_new, x.grad = x.grad.clone(), None
    old = x[order // k]
    unsorted_old = torch.empty_like(old).index_copy(0, order, old * 3)
    unsorted_old.backward(g)
    assert torch.equal(new, old) and torch.equal(unsorted_new, unsorted_old) and torch.equal(grad_new, x.grad)


def test_sequence_counts_scatter_equals_the_loop_over_sequences():
    gen = torch.Generator().manual_seed(0)
    s, b, k, e = 9, 3, 2, 6
    experts = torch.randint(0, e, (s, b, k), generator=gen)
    probs = torch.rand(s, b, e, generator=gen)
    sums, counts = sequence_balance_terms(probs, experts, e)
    want = torch.zeros(b, e)
    for j in range(b):
        want[j].index_add_(0, experts[:, j].reshape(-1), torch.ones(s * k))
    assert torch.equal(counts, want) and torch.equal(sums, probs.sum(0))


def _block() -> MoE:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.1, shared_experts=1)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, moe=moe)
    m = MoE(cfg, TensorParallel())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    m.global_sequences = 3
    return m.to(torch.bfloat16)


def test_moe_block_compiles_as_one_graph_and_counts_its_statistics_once(grouped):
    from torch._dynamo.utils import counters

    m = _block()
    x = torch.randn(16, 3, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_()
    r = torch.randn(16, 3, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def grads(fn):
        (fn(x).float() * r).sum().backward()
        out = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
        x.grad = None
        m.zero_grad()
        return out

    want = grads(m)
    stats = m._stats.clone()
    torch._dynamo.reset()
    counters.clear()
    block = torch.compile(m, backend="aot_eager", fullgraph=True)
    got = grads(block)
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(m._stats, 2 * stats) and m.stats_tokens.sum() == 2 * 2 * 16 * 3
    checkpointed = grads(lambda t: torch.utils.checkpoint.checkpoint(block, t, use_reentrant=False))
    for a, b in zip(checkpointed, want):
        assert torch.equal(a, b)
    assert torch.equal(m._stats, 3 * stats)  # the recomputation in backward adds nothing
    torch._dynamo.reset()


def test_moe_block_on_the_grouped_path_has_no_host_sync(grouped):
    """Forward and backward dispatch none of the ops that make the host wait on a GPU
    (`tests/test_host_sync.py`'s list, and `bincount`, whose output size is read on the host)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.test_host_sync import HOST_SYNC_OPS

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket._qualified_op_name.replace("::", "."))
            return func(*args, **(kwargs or {}))

    m = _block()
    x = torch.randn(16, 3, 32).to(torch.bfloat16).requires_grad_()
    with Ops() as ops:
        m(x).float().sum().backward()
    assert "aten._grouped_mm" in ops.seen and "trainer.moe_add_stats" in ops.seen
    assert not ops.seen & (HOST_SYNC_OPS | {"aten.bincount"})


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast"])
def test_grouped_mm_probe_passes_when_the_first_forward_has_no_autograd(mode):
    """The probe's answer is cached for the process, and the bench's (and an evaluation's) first
    MoE forward runs under `no_grad`: the probe's `backward` raised there and the answer stayed
    False, so the H100's eager layer and step took the loop over slices (issue 37)."""
    context = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }[mode]
    _grouped_mm_runs.cache_clear()
    try:
        with context():
            assert _grouped_mm_runs(torch.device("cpu")) is True
    finally:
        _grouped_mm_runs.cache_clear()


def test_grouped_mm_probe_inside_a_compiled_graph_under_no_grad():
    """Dynamo evaluates the probe while tracing (a constant): under `no_grad` too it answers True."""
    _grouped_mm_runs.cache_clear()
    torch._dynamo.reset()

    def f(t):
        return t * 2 if _grouped_mm_runs(t.device) else t

    try:
        with torch.no_grad():
            out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(3))
        assert out.tolist() == [2.0, 2.0, 2.0]
    finally:
        _grouped_mm_runs.cache_clear()
        torch._dynamo.reset()


def test_fp32_weights_under_autocast_reach_the_grouped_kernel_in_bf16(grouped):
    """fp32 parameters under bf16 autocast (the bench's fp32 step, a run without master weights):
    the grouped path casts the tokens and the expert weights to bf16 as autocast does for every
    matmul, so it computes exactly what it computes on bf16 copies of the weights, and the fp32
    weights' gradients are those bf16 gradients, upcast."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(22, 16, generator=gen).requires_grad_()
    gate_up = torch.randn(4, 32, 16, generator=gen).requires_grad_()
    down = torch.randn(4, 16, 16, generator=gen).requires_grad_()
    counts, g = torch.tensor([5, 0, 9, 8]), torch.randn(22, 16, generator=gen).to(torch.bfloat16)
    seen = []
    real = torch._grouped_mm

    def spy(a, b, **kw):
        seen.append((a.dtype, b.dtype))
        return real(a, b, **kw)

    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_grouped_mm", spy)
        y = grouped_swiglu(x, gate_up, down, counts)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and seen == [(torch.bfloat16, torch.bfloat16)] * 2

    xb, gb, db = (t.detach().to(torch.bfloat16).requires_grad_() for t in (x, gate_up, down))
    want = grouped_swiglu(xb, gb, db, counts)
    want.backward(g)
    assert torch.equal(y, want)
    for fp32, bf16 in zip((x, gate_up, down), (xb, gb, db)):
        assert fp32.grad.dtype == torch.float32 and torch.equal(fp32.grad, bf16.grad.float())


def _layer_rows(tmp_path, *extra: str, dtype: torch.dtype | None = None) -> list[dict]:
    """The bench's layer rows at `moe-tiny` on the CPU, in `dtype` (default: the CPU's fp32; bf16
    as on CUDA, whose fake `_grouped_mm` the compiled grouped path needs)."""
    from tests.scripts import bench_module

    mb = bench_module("moe_bench")
    argv = ["--preset", "moe-tiny", "--micro-batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0"]
    with pytest.MonkeyPatch.context() as mp:
        if dtype is not None:
            real = mb.bench_args
            mp.setattr(mb, "bench_args", lambda ap, argv: (*real(ap, argv)[:2], dtype))
        result = mb.main([*argv, *extra, "--device", "cpu", "--parts", "layer", "--out", str(tmp_path)])
    return result["rows"]


def test_moe_bench_counts_the_gemms_each_layer_variant_ran(grouped, tmp_path):
    """The bench reports the path from the ops the variant called (profiled), not from a
    re-derivation: forced onto the grouped path, the framework layer calls `_grouped_mm` twice
    forward and four times backward and `mm` only for the router (1 + 2); the plain loop calls
    `mm` three times per expert matmul (moe-tiny: 4 experts x 2, + the router) and never the
    grouped kernel. In bf16, as on CUDA. Compiled (`aot_eager`) the framework layer is one graph on the same kernels;
    the plain loop's frame is skipped by dynamo and its row says so. Speedups pair the modes."""
    rows = _layer_rows(tmp_path, "--profile", dtype=torch.bfloat16)
    assert [(r["variant"], r["compiled"]) for r in rows] == [
        ("framework", False),
        ("plain", False),
        ("framework", True),
        ("plain", True),
    ]
    ours, plain, ours_c, plain_c = rows
    for r in (ours, ours_c):
        assert (r["grouped_mm"], r["grouped_mm_calls"], r["mm_calls"]) == (True, 6, 3)
    for r in (plain, plain_c):
        assert (r["grouped_mm"], r["grouped_mm_calls"], r["mm_calls"]) == (False, 0, 27)
    assert ours_c["graph_breaks"] == 0 and ours_c["frames_skipped"] == 0 and "note" not in ours_c
    assert plain_c["graph_breaks"] == 1 and plain_c["frames_skipped"] == 1 and "skipped 1 frame" in plain_c["note"]
    assert ours["speedup_vs_plain"] == pytest.approx(plain["ms"] / ours["ms"])
    assert ours_c["speedup_vs_plain"] == pytest.approx(plain_c["ms"] / ours_c["ms"])
    profile = (tmp_path / "moe_profile.txt").read_text()
    assert [line for line in profile.splitlines() if line.startswith("==")] == [
        "== framework eager: 1 call",
        "== plain eager: 1 call",
        "== framework compiled: 1 call",
        "== plain compiled: 1 call",
    ]
    assert "aten::_grouped_mm" in profile


def test_moe_bench_reports_the_loop_where_the_loop_ran(tmp_path):
    """Unforced on the CPU the framework takes the loop over slices, and its row says so."""
    ours, plain = _layer_rows(tmp_path, "--no-compile")
    assert (ours["grouped_mm"], ours["grouped_mm_calls"], ours["mm_calls"]) == (False, 0, 27)
    assert ours["max_abs_diff"] < 1e-5 and "graph_breaks" not in ours
