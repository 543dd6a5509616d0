"""GPU-only paths against their CPU-tested references (skipped without CUDA; on the device
machine, without pytest: `python tests/test_gpu.py [NAME ...]` from the repository root)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: the repository's packages, as pytest's rootdir gives them
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.optim.adamw_update import (  # noqa: E402
    BLOCK,
    UpdateState,
    adamw_update,
    adamw_update_tensors,
    stacked_coefficients,
)
from trainer.optim.multi_tensor import TensorBlocks  # noqa: E402

try:
    import pytest
except ImportError:  # the device machine has no pytest: `python tests/test_gpu.py [NAME ...]` runs them

    def cuda(test):
        return test

else:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_triton_update_on_grad_tensors_equals_the_compiled_flat_update():
    """Tensors of odd sizes, decay on the first ones, clipping scale != 1, several steps: the
    one-launch update over `.grad` tensors and the compiled flat update agree to fp32 rounding,
    each one's masters equal torch AdamW's on fp32 copies, and the bf16 parameters are each
    one's rounding of its master."""
    from tests.bf16 import rounded_half_away
    from trainer.optim.adamw_update import join_fp32, split_fp32

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    numels = [3 * 1024 + 37, 4096, 5, 1, 2048 * 3]
    offsets = [0]
    for n in numels[:-1]:
        offsets.append(offsets[-1] + -(-n // 64) * 64)
    total = offsets[-1] + numels[-1]
    n_decay = offsets[2]
    master = torch.zeros(total, device=dev)  # the gaps between tensors stay zero, as in the optimizer
    for o, n in zip(offsets, numels):
        master[o : o + n] = torch.randn(n, device=dev, generator=g)
    ref = [torch.nn.Parameter(master[o : o + n].clone()) for o, n in zip(offsets, numels)]
    ref_opt = torch.optim.AdamW(
        [{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    states = {}
    for k in ("flat", "tensors"):
        remainder, param = (
            torch.empty(total, dtype=torch.int16, device=dev),
            torch.empty(total, dtype=torch.bfloat16, device=dev),
        )
        split_fp32(master, param, remainder)
        states[k] = (remainder, torch.zeros_like(master), torch.zeros_like(master), param)
    flat_update = torch.compile(adamw_update, fullgraph=True, dynamic=False)
    blocks = TensorBlocks.build(offsets, numels, dev, BLOCK)
    lr = torch.tensor(3e-3, dtype=torch.float64, device=dev)
    scale = torch.tensor(0.7, device=dev)
    for t in range(1, 4):
        step = torch.tensor(float(t), dtype=torch.float64, device=dev)
        grads = [torch.randn(n, device=dev, generator=g).bfloat16() for n in numels]
        flat_grad = torch.zeros(total, dtype=torch.bfloat16, device=dev)
        for o, n, gr in zip(offsets, numels, grads):
            flat_grad[o : o + n] = gr
        r, m, v, p = states["flat"]
        flat_update(r, flat_grad, m, v, p, lr, step, scale, n_decay, 0.9, 0.95, 1e-8, 0.1)
        r, m, v, p = states["tensors"]
        coefficients = stacked_coefficients(lr, step, scale, 0.9, 0.95, 0.1)
        adamw_update_tensors(UpdateState(r, m, v, p, blocks, coefficients, n_decay, 0.9, 0.95, 1e-8), grads)
        for w, gr in zip(ref, grads):
            w.grad = gr.float() * 0.7
        ref_opt.step()
    masters = {k: join_fp32(p, r) for k, (r, _, _, p) in states.items()}
    torch.testing.assert_close(masters["flat"], masters["tensors"], rtol=1e-6, atol=1e-7)
    for a, b in zip(states["flat"][1:3], states["tensors"][1:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for k, (_, _, _, p) in states.items():
        assert torch.equal(p, rounded_half_away(masters[k])), k
        for o, n, w in zip(offsets, numels, ref):
            torch.testing.assert_close(masters[k][o : o + n], w.detach(), rtol=1e-6, atol=1e-7)


@cuda
def test_triton_cross_entropy_matches_the_torch_op_at_the_bench_vocabulary():
    from trainer.model.ops import cross_entropy as ce

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, vocab, padded = 4096, 32000, 32064
    logits = (4 * torch.randn(n, padded, device=dev, generator=g)).bfloat16()
    target = torch.randint(0, vocab, (n,), device=dev, generator=g)
    target[::7] = -100
    grad = torch.randn(n, device=dev, generator=g)
    loss, lse = ce.cross_entropy_triton(logits, target, vocab, -100)
    want_loss, want_lse = ce.cross_entropy_torch(logits.double(), target, vocab, -100)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    d = ce.cross_entropy_backward_triton(grad, logits, target, lse, vocab, -100)
    want = ce.cross_entropy_backward_torch(grad, logits, target, lse, vocab, -100)
    assert not d[:, vocab:].any()
    assert ((d.float() - want.float()).abs() <= 2.0**-7 * want.float().abs() + 1e-9).all()  # one bf16 ulp


@cuda
def test_triton_rope_matches_the_compiled_torch_ops_at_the_bench_shape():
    """The 1B layer's shape, bf16: q, k, v within one bf16 rounding of the torch ops' (fp32
    contraction may differ); attention's output and the projection's gradient, compiled as in a
    block, as close to the fp32 computation as the torch ops' are (relative norms of the errors)."""
    from trainer.model.layers import causal_attention, rope_tables
    from trainer.model.ops import rope

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    s, b, h, kv, hd = 2048, 8, 32, 8, 64
    cos, sin = rope_tables(s, hd, 500000.0, device=dev)
    x = torch.randn(s, b, (h + 2 * kv) * hd, device=dev, generator=g).bfloat16()
    grad = torch.randn(s, b, h * hd, device=dev, generator=g).bfloat16()
    results = []
    for fn, dtype in (
        (rope.rope_qkv, torch.bfloat16),
        (rope.rope_qkv_torch, torch.bfloat16),
        (rope.rope_qkv_torch, torch.float32),
    ):
        qkv = x.detach().clone().to(dtype).requires_grad_()
        core = torch.compile(lambda t, fn=fn: causal_attention(*fn(t, cos, sin, h, kv), "sdpa"), dynamic=False)
        parts = fn(qkv, cos, sin, h, kv)
        out = core(qkv)
        out.backward(grad.to(dtype))
        results.append(([p.detach() for p in parts], out.detach().float(), qkv.grad.float()))
    (p0, o0, g0), (p1, o1, g1), (_, o32, g32) = results
    for a, w in zip(p0, p1):
        assert ((a.float() - w.float()).abs() <= 2.0**-8 * w.float().abs() + 1e-6).all()

    def err(a, w):
        return ((a - w).norm() / w.norm()).item()

    for name, op, torch_ops, ref in (("output", o0, o1, o32), ("gradient", g0, g1, g32)):
        assert err(op, ref) <= 1.1 * err(torch_ops, ref) + 1e-4, (name, err(op, ref), err(torch_ops, ref))


@cuda
def test_triton_sums_of_squares_match_float64_on_bf16_gradients():
    from trainer.optim.multi_tensor import SQUARES_BLOCK, sums_of_squares, uses_triton_squares

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ts = [
        torch.randn(n, device=dev, generator=g).bfloat16()
        for n in (32000 * 2048, 3072 * 2048, 2048, 1, SQUARES_BLOCK + 3)
    ]
    assert uses_triton_squares(ts)
    got = sums_of_squares(ts)
    want = torch.stack([(t.double() ** 2).sum() for t in ts])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    assert torch.equal(got, sums_of_squares(ts))


@cuda
def test_whole_stage_graph_matches_eager_for_every_recompute_mode():
    """The compiled stage (one graph at tp = 1, per block under full recompute) against
    the same model in eager mode, fp32 so that the comparison is tight: per-token losses and
    every parameter's gradient, recompute none, selective and full."""
    from trainer.config.presets import PRESETS
    from trainer.config.schema import ModelConfig, ParallelismConfig
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    dev = torch.device("cuda")
    pc = ParallelContext.single(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, 256, (3, 32), device=dev, generator=g)
    labels = torch.randint(0, 256, (3, 32), device=dev, generator=g)
    labels[0, :5] = -100
    for mode in ("none", "selective", "full"):
        results = []
        for compiled in (True, False):
            cfg = ModelConfig(**{**PRESETS["tiny"], "n_layers": 3}, compile=compiled)
            model = Llama(cfg, ParallelismConfig(recompute=mode), pc, seed=0)
            assert model._whole_graph == (compiled and mode != "full")
            losses = model(None, {"input_ids": ids, "labels": labels})
            losses.sum().backward()
            results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (l0, g0), (l1, g1) = results
        torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-5, msg=mode)
        assert not l0[0, :5].any()
        for n in g1:
            torch.testing.assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-5, msg=f"{mode} {n}")


@cuda
def test_compiled_stage_under_changing_batch_sizes_matches_eager():
    """trainer/model/batch_compile.py on the GPU: inductor and the Triton ops with the batch
    dimension symbolic (sizes past the first two), fp32, losses and gradients against eager for
    every size, with no more graphs than the CPU test counts (two static, one symbolic, dynamo's
    batch of one)."""
    from torch._dynamo.utils import counters

    from trainer.config.presets import PRESETS
    from trainer.config.schema import ModelConfig
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    dev = torch.device("cuda")
    pc = ParallelContext.single(dev)
    torch._dynamo.reset()
    counters.clear()  # reset() leaves the process-wide counters with the earlier tests' graphs
    models = [Llama(ModelConfig(**{**PRESETS["tiny"], "n_layers": 3}, compile=c), pc=pc, seed=0) for c in (True, False)]
    g = torch.Generator(device=dev).manual_seed(0)
    for b in (4, 2, 3, 5, 1, 6, 4):
        ids = torch.randint(0, 256, (b, 32), device=dev, generator=g)
        got, want = (m(None, {"input_ids": ids, "labels": ids}) for m in models)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"batch {b}")
        got.sum().backward()
        want.sum().backward()
    grads = [dict(m.named_parameters()) for m in models]
    for n, p in grads[1].items():
        torch.testing.assert_close(grads[0][n].grad, p.grad, rtol=1e-4, atol=1e-4, msg=n)
    assert counters["stats"]["unique_graphs"] <= 4


@cuda
def test_gram_and_row_products_of_bf16_gradients_take_the_skinny_product_kernel():
    """DoGE's one-pass products (trainer/run/alignment.py `rows_gram`, `rows_dot`) on bf16 G
    [k + 1, n] at the 1B embedding's size: the Triton skinny-product kernel
    (trainer/model/ops/skinny_products_triton.py; before it, one GEMM with an fp32 output, which
    ran at a tenth of the bandwidth), bitwise the same on a second call, fp32-accurate against
    fp64: within the error of an fp32 sum of n products, c sqrt(n) 2^-24 sum_k |g_ik g_jk| (c = 4;
    the ninth session's H100 measured 45,782 at the diagonal's 6.5e7, 0.7e-3 relative, c = 1.4,
    for the GEMM, where the earlier rtol 1e-5 had asked for more than an fp32 sum over 65M terms
    gives). The bound is about a bf16 output's rounding of the diagonal (2^-9 relative, 1.3e5
    here), so the dtype assertion, not the bound, tells an fp32 output apart. `combine` (the
    `weighted_rows` kernel) gives the GEMV's update to one bf16 ulp. `group_gram` (one
    `summed_gram` call: one kernel launch a parameter into one buffer, summed in fp64) within the
    same bound, repeatable and symmetric; fp32 rows whose tf32 rounding is 2^-12 off exact to the
    bound (the kernel's fp32 dot is "ieee", not tf32); and no kernel fell back."""
    from trainer.run import alignment

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    flat = torch.randn(5, 32000 * 2048, device=dev, generator=g).bfloat16()
    assert alignment._skinny_kernels() is not None, "Triton is not importable"
    gram, dots = alignment.rows_gram(flat), alignment.rows_dot(flat[:4], flat[4])
    assert gram.dtype == dots.dtype == torch.float32
    assert torch.equal(gram, alignment.rows_gram(flat)) and torch.equal(gram, gram.t())
    assert torch.equal(dots, alignment.rows_dot(flat[:4], flat[4]))
    exact = flat.double()
    want = exact @ exact.t()
    bound = 4 * flat.shape[1] ** 0.5 * 2.0**-24 * (exact.abs() @ exact.abs().t())
    assert ((gram.double() - want).abs() <= bound).all(), ((gram.double() - want).abs() / bound).max()
    assert ((dots.double() - want[:4, 4]).abs() <= bound[:4, 4]).all()
    scale = torch.randn(4, device=dev, generator=g, dtype=torch.float64)
    update = alignment.combine(scale, flat[:4].view(4, 32000, 2048))
    gemv = torch.mv(flat[:4].t(), scale.to(flat.dtype)).view(32000, 2048)
    assert update.dtype == torch.bfloat16 and torch.equal(
        update, alignment.combine(scale, flat[:4].view(4, 32000, 2048))
    )
    assert ((update.double() - gemv.double()).abs() <= gemv.double().abs() * 2.0**-7 + 1e-3).all()
    small = torch.randn(5, 3, 2048, device=dev, generator=g).bfloat16()
    params = [flat.view(5, 32000, 2048), small, torch.randn(5, 7, device=dev, generator=g).bfloat16()]
    summed = alignment.group_gram(params, [True, True, False], here=True)
    assert summed.dtype == torch.float64 and torch.equal(summed, summed.t())
    assert torch.equal(summed, alignment.group_gram(params, [True, True, False], here=True))
    tail = small.reshape(5, -1).double()
    bound_sum = bound + 4 * tail.shape[1] ** 0.5 * 2.0**-24 * (tail.abs() @ tail.abs().t())
    assert ((summed - want - tail @ tail.t()).abs() <= bound_sum).all()
    t = torch.randn(6, 1 << 20, device=dev, generator=g)
    x = (t.view(torch.int32) & ~0x1FFF).view(torch.float32) * (1 + 2.0**-12)  # tf32 takes x to t
    xd = x.double()
    bound32 = 4 * x.shape[1] ** 0.5 * 2.0**-24 * (xd.abs() @ xd.abs().t())
    assert ((alignment.rows_gram(x).double() - xd @ xd.t()).abs() <= bound32).all()
    assert ((alignment.rows_dot(x[:5], x[5]).double() - xd[:5] @ xd[5]).abs() <= bound32[:5, 5]).all()
    # the tuned launch (warps and stages timed at the first call) gives the bits of every choice
    from trainer.model.ops import skinny_products_triton as sk

    flats = [flat, small.reshape(5, -1)]
    tuned = sk.summed_gram(flats)
    assert sk.tuned_choices() and not sk.TUNING_FAILED, sk.TUNING_FAILED
    for warps, stages in sk.CHOICES:
        assert torch.equal(sk.summed_gram(flats, warps=warps, stages=stages), tuned), (warps, stages)
    assert not alignment._TRITON_PRODUCTS_FAILED, alignment._TRITON_PRODUCTS_FAILED


@cuda
def test_a_profile_says_where_the_gpu_waited_for_the_host():
    """experiments/tools/bench/timing.py `profile_table` on CUDA: the kernels' table, then the GPU's
    idle time with its longest gaps (a host sleep between two launches is one of them), then the
    ops by host time."""
    import importlib.util
    import time

    path = Path(__file__).resolve().parents[1] / "experiments" / "tools" / "bench" / "timing.py"
    spec = importlib.util.spec_from_file_location("bench_timing", path)
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)

    def step():
        a @ a
        torch.cuda.synchronize()
        time.sleep(0.02)
        a @ a

    step()
    text = timing.profile_table(step, dev, 10)
    idle_line = next(line for line in text.splitlines() if line.startswith("GPU idle:"))
    assert float(idle_line.split()[2]) >= 15.0, idle_line
    assert "by host time:" in text


@cuda
def test_doge_one_pass_on_cuda_gives_each_groups_own_gradient():
    """DoGE's one pass on CUDA, compiled (trainer/run/group_grads.py: batch-first activations,
    RoPE's Triton kernels on a transposed view, one GEMM per group, the fused loss), fp32: each
    parameter's G[g] equals the gradient of group g's own loss by autograd through the model's
    usual [s, b, d] layout (groups of 3, 0, 1 and 2 rows, two micro-batches)."""
    from tests.group_grads_case import per_group_grads
    from trainer.config.schema import model_config
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    dev = torch.device("cuda")
    model = Llama(model_config(preset="tiny", compile=True), pc=ParallelContext.single(dev))
    named = list(model.named_parameters())
    k, groups, s = 4, [0, 0, 0, 2, 3, 3], 32
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 256, (len(groups), s), generator=gen)
    labels[0, :2] = -100
    batch = {
        "input_ids": torch.randint(0, 256, (len(groups), s), generator=gen).to(dev),
        "labels": labels.to(dev),
        "domain_ids": torch.tensor(groups, device=dev),
    }
    mask = batch["labels"] != -100
    n = torch.stack([(mask & (batch["domain_ids"] == g)[:, None]).sum() for g in range(k)]).float()
    w = mask.float() / n.clamp_min(1)[batch["domain_ids"]][:, None]
    got = per_group_grads(model, named, batch, w, k)
    assert not model.batch_first and all(p.grad is None for _, p in named)
    for g in range(k):
        loss = (model(None, batch) * w * (batch["domain_ids"] == g)[:, None]).sum()
        want = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, p), G, ref in zip(named, got, want):
            ref = torch.zeros_like(p) if ref is None else ref
            scale = ref.abs().max().item() + 1e-6
            assert (G[g] - ref).abs().max().item() <= 1e-4 * scale + 1e-7, (name, g)
    assert not got[0][1].any()


@cuda
def test_doge_embedding_gradients_on_cuda_sum_in_fp32_without_a_host_sync():
    """DoGE's per-group embedding gradients (trainer/run/group_grads.py `group_embedding_grads`)
    at 1B's sizes (9 rows of 2048 tokens, groups 2, 2, 2, 2, 1, vocabulary 32000, d 2048), bf16:
    each [group, id] within one bf16 rounding of the fp64 sum of its tokens' gradients, bitwise
    the same on a second call, and no host synchronisation (the step ends without host reads)."""
    from trainer.run.group_grads import group_embedding_grads

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, 32000, (9, 2048), device=dev, generator=gen)
    ids[:, :512] = torch.randint(0, 50, (9, 512), device=dev, generator=gen)  # ids repeated within and across rows
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4], device=dev)
    g = torch.randn(9, 2048, 2048, device=dev, generator=gen).bfloat16()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = group_embedding_grads(g, ids, rows, 5, 32000, torch.bfloat16)
        again = group_embedding_grads(g, ids, rows, 5, 32000, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    index = (rows[:, None] * 32000 + ids).reshape(-1)
    want = torch.zeros(5 * 32000, 2048, dtype=torch.float64, device=dev).index_add_(
        0, index, g.reshape(-1, 2048).double()
    )
    scale = torch.zeros_like(want).index_add_(0, index, g.reshape(-1, 2048).double().abs())
    err = (got.reshape(-1, 2048).double() - want).abs()
    assert (err <= 2.0**-8 * want.abs() + 2.0**-20 * scale).all()
    assert torch.equal(got, again)


@cuda
def test_group_norm_backward_on_cuda_matches_the_torch_path():
    """RMSNorm's backward for DoGE's one pass (trainer/model/ops/group_norm_backward.py) at 1B's
    norm shape, bf16 inputs ([9, 2048, 2048], groups 2, 2, 2, 2, 1), with and without the residual
    stream's gradient: the Triton kernels' dx within one bf16 rounding of the fp64 value (plus
    fp32 rounding of its terms) and their per-group weight gradients the torch path's fp64 sums
    to fp32 rounding, bitwise the same on a second call."""
    from trainer.model.ops import group_norm_backward as nb

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x, dy, res = (torch.randn(9, 2048, 2048, device=dev, generator=g).bfloat16() for _ in range(3))
    w = torch.randn(2048, device=dev, generator=g).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4], device=dev)
    scale = (dy.double().abs() * x.double().abs() * rstd.double()).sum((0, 1))
    for residual in (None, res):
        dx, dw = nb.group_norm_backward(dy, x, rstd, w, rows, 5, torch.float32, residual)
        wide = [t if t is None else t.double() for t in (dy, x, rstd, w, residual)]
        want_dx, want_dw = nb.group_norm_backward_torch(*wide[:4], rows, 5, torch.float64, wide[4])
        gw, x_hat = (wide[0] * wide[3]).abs(), wide[1].abs() * wide[2]
        terms = wide[2] * (gw + x_hat * (gw * x_hat).mean(-1, keepdim=True)) + (
            0 if residual is None else wide[4].abs()
        )
        assert ((dx.double() - want_dx).abs() <= 2.0**-8 * want_dx.abs() + 1e-5 * terms).all()
        assert ((dw.double() - want_dw).abs() <= 4 * (2 * 2048) ** 0.5 * 2.0**-24 * scale).all()
        again = nb.group_norm_backward(dy, x, rstd, w, rows, 5, torch.float32, residual)
        assert torch.equal(dx, again[0]) and torch.equal(dw, again[1])


@cuda
def test_the_update_of_combined_gradients_equals_the_update_of_their_written_sum_on_cuda():
    """`MasterWeightAdamW.combine_gradients` on CUDA (DoGE's one-pass update summed inside the
    AdamW kernel, never written) against the same rows summed by `alignment.combine` (the
    `weighted_rows` kernel) and written as `.grad`, the clip's norm handed over: bitwise the
    same parameters, remainders and moments over three steps, at the 1B MLP's row width."""
    from tests.combined_update_case import combined_against_written
    from trainer.config.schema import TrainConfig
    from trainer.optim.master_weights import MasterWeightAdamW
    from trainer.parallel.context import ParallelContext
    from trainer.run import alignment

    dev = torch.device("cuda")
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, micro_batches=1)
    shapes = {"w1": (2048, 5632), "norm": (2048,), "w2": (5632, 2048)}

    def built():
        g = torch.Generator(device=dev).manual_seed(0)
        named = [(n, torch.nn.Parameter(torch.randn(s, generator=g, device=dev))) for n, s in shapes.items()]
        return MasterWeightAdamW(named, cfg, ParallelContext.single(dev))

    combined_against_written(built(), built(), shapes, alignment.combine, dev, 4)


@cuda
def test_the_device_timer_counts_the_timed_work_not_the_work_queued_before_it():
    """Some 100 ms of matrix products queued, then one small product timed: the events measure
    the small product alone (under 5 ms), while the host's clock around the same block, ended by
    a host read, also counts the queued products (over 50 ms)."""
    import time

    from trainer.run.device_timer import DeviceTimer

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    small = torch.randn(256, 256, device=dev)
    (a @ a, (small @ small).sum().item())  # the libraries' first calls, untimed
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 4
    for _ in range(max(1, int(0.1 / per))):
        a @ a
    t0 = time.perf_counter()
    with DeviceTimer(dev) as timer:
        (small @ small).sum().item()
    host = time.perf_counter() - t0
    assert timer.seconds() < 5e-3, timer.seconds()
    assert host > 0.05, host


def _in_order(chosen: list[str]) -> list:
    """The tests to run: every one in name order, or those whose names hold one of the words
    `chosen`, in the order of the first word each holds (a call short of time runs the checks
    named first)."""
    tests = [f for name, f in sorted(globals().items()) if name.startswith("test_") and callable(f)]
    if not chosen:
        return tests
    rank = {t: next((i for i, part in enumerate(chosen) if part in t.__name__), None) for t in tests}
    return sorted((t for t in tests if rank[t] is not None), key=lambda t: rank[t])


if __name__ == "__main__":
    failed = []
    for test in _in_order(sys.argv[1:]):
        try:
            test()
        except Exception as e:  # noqa: BLE001 - every check runs; the failures are listed at the end
            traceback.print_exc()
            failed.append(f"{test.__name__}: {type(e).__name__}: {str(e)[:300]}")
            print("FAILED", test.__name__, flush=True)
            continue
        print("passed", test.__name__, flush=True)
    print("\n".join(["failed:", *failed]) if failed else "ok")
    sys.exit(1 if failed else 0)
