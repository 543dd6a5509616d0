"""DoGE's one-pass step (`mixing.doge.one_pass`): per-group weight gradients from one forward and
backward (trainer/run/group_grads.py) equal each group's own backward, and the aligned step
(trainer/run/alignment.py `_one_pass`, the target's sequences folded in as one more group) writes
the k-pass step's update, products and weights."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import trainer.run.alignment as alignment
from doremi.methods.doge import check_layout, one_pass
from doremi.methods.history import read_history
from doremi.pipeline import stages
from tests.group_grads_case import per_group_grads
from tests.interpreter import needs_triton, run_interpreted
from tests.runs import config, losses
from tests.test_method_doge import fit_capturing_gradients
from tests.test_model import _cfg
from trainer.config.fp8 import Fp8Config
from trainer.config.moe import MoEConfig
from trainer.config.tools import ConfigError
from trainer.model.llama import Llama
from trainer.run.group_grads import GroupGrads, group_embedding_grads, group_offsets, segment_grads

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(groups: list[int], s: int = 12, vocab: int = 256, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = len(groups)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :2] = -100
    return {
        "input_ids": torch.randint(0, vocab, (b, s), generator=g),
        "labels": labels,
        "domain_ids": torch.tensor(groups),
    }


def _weights(batch: dict, k: int) -> torch.Tensor:
    """Per-token weight 1 / n_g on group g's tokens: the sum over groups of each group's mean loss."""
    mask = batch["labels"] != -100
    ids = batch["domain_ids"]
    n = torch.stack([(mask & (ids == g)[:, None]).sum() for g in range(k)]).double()
    return mask.double() * (1.0 / n.clamp_min(1))[ids][:, None]


@pytest.mark.parametrize("tied", [False, True])
def test_per_group_gradients_equal_each_groups_own_backward(tied):
    """Groups of 3, 0, 1 and 2 rows (one empty), in two micro-batches: G[g] of every parameter
    of a tiny dense Llama (fp64) equals the gradient of group g's mean loss by autograd alone."""
    k, groups = 4, [0, 0, 0, 2, 3, 3]
    model = Llama(_cfg(tie_embeddings=tied)).double()
    named = list(model.named_parameters())
    batch = _rows(groups)
    w = _weights(batch, k)
    got = per_group_grads(model, named, batch, w, k)
    assert all(p.grad is None for _, p in named)
    assert "forward" not in vars(model) and all(getattr(m, "fp8", None) is None for m in model.modules())
    assert not model.batch_first and not any(getattr(m, "batch_first", False) for m in model.modules())
    for g in range(k):
        rows = batch["domain_ids"] == g
        loss = (model(None, batch) * w * rows[:, None]).sum()
        want = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, p), G, ref in zip(named, got, want):
            assert G.shape == (k, *p.shape)
            torch.testing.assert_close(
                G[g], torch.zeros_like(p) if ref is None else ref, rtol=1e-10, atol=1e-13, msg=name
            )
    assert not got[0][1].any()  # the empty group


def test_the_compiled_stage_takes_one_more_graph_and_keeps_it(monkeypatch):
    """The compiled model (one graph per stage, as on CUDA; here dynamo with AOTAutograd's eager
    backend on the CPU): over 3 steps of an ordinary pass then a one-pass one, dynamo makes two
    graphs (no recompile per step, no graph break), whose per-group gradients are the eager
    model's (the weight gradients' op `trainer::group_weight_grads` traced as one node)."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[int] = []
    real = torch.compile

    def backend(gm, inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: real(fn, backend=backend, dynamic=dynamic))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    k, cfg = 3, _cfg(tie_embeddings=True)
    model, eager = Llama(cfg), Llama(cfg)
    for m in (model, eager):
        m._fused_loss = True  # the tp = 1 head of a compiled model (LlamaStage.__init__)
    model._compiled = True
    model.set_recompute("none")
    try:
        for step in range(3):
            batch = _rows([0, 0, 1, 1, 1, 2], seed=step)
            model(None, batch).sum().backward()  # an ordinary pass (the target's)
            got = []
            for m in (model, eager):
                with GroupGrads(m, list(m.named_parameters()), k) as gg:
                    gg.announce(batch, group_offsets(batch["domain_ids"].tolist(), k))
                    m(None, batch).sum().backward()
                got.append(gg.grads())
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert len(graphs) == 2 and not torch._dynamo.utils.counters["graph_break"]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_norms_and_update_from_the_stacked_gradients(dtype):
    """`group_products` and `combine` on G [3, ...] of two parameters (one not counted) against
    fp64: the products and norms fp32-accurate whatever G's dtype, the update to G's precision."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 40, 50, generator=gen).to(dtype), torch.randn(3, 7, generator=gen).to(dtype)]
    target = [torch.randn(40, 50, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype)]
    got = alignment.group_products(grads, target, [True, False], norms=True, here=True)
    g, t = grads[0].double().reshape(3, -1), target[0].double().reshape(-1)
    # fp32 sums of 2000 products: about sqrt(2000) x 6e-8 = 3e-6 relative, in an order each
    # CPU's kernels choose (1.2e-6 seen on one host, below 1e-6 on another)
    torch.testing.assert_close(got, torch.stack([g @ t, (g * g).sum(1)]), rtol=1e-5, atol=1e-9)
    assert not alignment.group_products(grads, target, [True, True], norms=False, here=False).any()
    scale = torch.tensor([0.5, -1.25, 2.0], dtype=torch.float64)
    want = (scale[:, None, None] * grads[0].double()).sum(0)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alignment.combine(scale, grads[0]).double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_weight_gradients_by_group_of_batch_first_rows(out):
    """`segment_grads` on bf16 batch-first activations [b, s, .] with groups of 3, 0, 1 and 2
    rows, into fp32 (main gradients) and bf16: each group's g^T x (one GEMM, K = rows x s)
    against fp64, within one bf16 rounding of the GEMM's output; the empty group exact zeros;
    the compiled graph (AOTAutograd) gives the same numbers through the opaque op; a slice of a
    wider tensor (strided rows) and a transposed view (the qkv projection's gradient, RoPE's
    [s, b, .] transposed) give the contiguous tensors' numbers."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(16, 6, 24, generator=gen).bfloat16().transpose(0, 1)
    x = torch.randn(6, 16, 28, generator=gen).bfloat16()[..., 4:24]
    offsets = (0, 3, 3, 4, 6)
    got = segment_grads(g, x, offsets, out)
    assert got.dtype == out and got.shape == (4, 24, 20) and not got[1].any()
    for i in (0, 2, 3):
        gi, xi = g[offsets[i] : offsets[i + 1]].double(), x[offsets[i] : offsets[i + 1]].double()
        want = torch.einsum("bso,bsi->oi", gi, xi)
        scale = torch.einsum("bso,bsi->oi", gi.abs(), xi.abs())
        assert ((got[i].double() - want).abs() <= 2.0**-8 * scale + 1e-6).all(), i
    assert torch.equal(segment_grads(g.contiguous(), x.contiguous(), offsets, out), got)
    assert torch.equal(torch.compile(segment_grads, backend="aot_eager")(g, x, offsets, out), got)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_embedding_gradients_by_group(out):
    """`group_embedding_grads`: rows of groups 0, 0, 2 (group 1 empty: zeros), repeated ids within
    and across rows: each [group, id] the fp64 sum of its tokens' gradients, to one rounding in
    the dtype asked for; the op's registration checks; the compiled graph (AOTAutograd) gives the
    same numbers through the opaque op."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1, 4, 1, 0], [4, 4, 2, 1], [0, 3, 3, 3]])
    rows = torch.tensor([0, 0, 2])
    g = torch.randn(3, 4, 5, generator=gen).bfloat16()
    got = group_embedding_grads(g, ids, rows, 3, 6, out)
    want = torch.zeros(3, 6, 5, dtype=torch.float64)
    for r in range(3):
        for t in range(4):
            want[rows[r], ids[r, t]] += g[r, t].double()
    assert got.dtype == out and got.shape == (3, 6, 5) and not got[1].any()
    step = 2.0**-24 if out == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= 3 * step * want.abs() + 1e-30).all()
    torch.library.opcheck(group_embedding_grads, (g, ids, rows, 3, 6, out))
    assert torch.equal(torch.compile(group_embedding_grads, backend="aot_eager")(g, ids, rows, 3, 6, out), got)


def test_group_offsets_need_sorted_rows():
    assert group_offsets([0, 0, 2, 3, 3], 4) == (0, 2, 2, 3, 5)
    assert group_offsets([], 2) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"^group gradients: rows must be sorted by group, got \[1, 0\]$"):
        group_offsets([1, 0], 2)


def test_a_parameter_without_a_per_group_gradient_is_refused():
    model = Llama(_cfg())
    model.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"^group gradients \(DoGE's one pass\): no per-group gradient for extra;"):
        GroupGrads(model, list(model.named_parameters()), 2)


SETS = ["train.decay=constant", "train.warmup_steps=0", "train.lr=0.01", "mixing.method=doge", "train.grad_clip=0"]


@pytest.mark.parametrize(
    "extra",
    [
        ["train.steps=2", "train.micro_batches=2", "mixing.doge.domain_grad_clip=0.05"],  # authors, the clip binding
        ["train.steps=2", "mixing.doge.variant=paper", "model.tie_embeddings=true"],
    ],
)
def test_one_pass_writes_the_k_pass_update(stores, tmp_path, extra):
    """The same proxy run with `one_pass` on and off: equal products, norms and weights at every
    step, and the same gradient written at the last (fp32 rounding)."""
    runs = {}
    for on in (False, True):
        cfg = config(stores, tmp_path / str(on), *SETS, *extra, f"mixing.doge.one_pass={str(on).lower()}")
        trainer = stages.proxy_trainer(cfg)
        assert trainer.hook.needs.alignment.one_pass is on
        runs[on] = (fit_capturing_gradients(trainer), read_history(tmp_path / str(on)))
    (k_pass, want), (one, got) = runs[False], runs[True]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for a, b in zip(want, got):
        # fp32 order of the sums: the weight gradients are summed a row at a time (1.07e-5 seen in
        # an alignment of 0.336, a sum of products that cancel)
        assert b["alignment"] == pytest.approx(a["alignment"], rel=3e-5, abs=1e-12)
        assert b["weights"] == pytest.approx(a["weights"], abs=1e-6)  # 1.2e-7 seen
        assert b.get("grad_norm") == (None if "grad_norm" not in a else pytest.approx(a["grad_norm"], rel=1e-5))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for name, g in k_pass.items():
        # the written gradient sums the domains' weighted gradients, which cancel: fp32 order
        # differences reach 6e-5 of a tensor's largest element (one CPU host), a wrong domain
        # weight or a lost domain moves it by 1e-3 and more
        torch.testing.assert_close(one[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)
    assert max(abs(x - 1 / 3) for x in got[-1]["weights"]) > 1e-3  # the weights moved
    if "grad_norm" in got[0]:
        assert got[0]["grad_norm"] == pytest.approx([0.05] * 3, rel=1e-5)  # every domain clipped


#: case -> (settings, the folded pass's micro-batch rows: 8 training rows (2 with the empty
#: domain) and T target rows, over the step's own count of micro-batches, as equal as can be).
FOLDS = {
    "authors, the clip binding on the target": (
        ["train.micro_batches=2", "mixing.doge.domain_grad_clip=0.05"],
        [4, 5],
    ),
    "T = 3 over two micro-batches": (["train.micro_batches=2", "mixing.doge.target_sequences=3"], [5, 6]),
    "an empty domain (2 sequences, 3 domains)": (
        ["train.global_batch_size=2", "mixing.doge.target_sequences=2"],
        [4],
    ),
    "paper, tied": (
        ["mixing.doge.variant=paper", "model.tie_embeddings=true", "mixing.doge.target_sequences=3"],
        [11],
    ),
}


@pytest.mark.parametrize(("extra", "rows"), list(FOLDS.values()), ids=list(FOLDS))
def test_the_folded_step_writes_the_k_pass_and_the_unfolded_update(stores, tmp_path, monkeypatch, extra, rows):
    """The target's sequences folded into the one pass as group k (`FOLD_TARGET`, one
    `train_schedule` per step, no copy of g_T) against the k-pass step and the one-pass step with
    the target's own pass: equal products, norms, weights, training loss and gradient written
    (fp32 rounding; one step, as Adam's first update turns the rounding of near-zero gradient
    elements into whole steps of the learning rate, which a second step's gradients would show)."""
    calls: list[list[int]] = []
    schedule, clips, clip = alignment.train_schedule, [], alignment.clip_coefficients

    def watched_schedule(model, batches, *args, **kwargs):
        calls.append([b["input_ids"].shape[0] for b in batches])
        return schedule(model, batches, *args, **kwargs)

    monkeypatch.setattr(alignment, "train_schedule", watched_schedule)

    def watched_clip(norms, max_norm):
        out = clip(norms, max_norm)
        if norms.dim() == 0:  # the folded step's target: the domains' come as one [k] call
            clips.append(out)
        return out

    monkeypatch.setattr(alignment, "clip_coefficients", watched_clip)
    runs = {}
    for name, on, fold in (("k-pass", False, True), ("unfolded", True, False), ("folded", True, True)):
        monkeypatch.setattr(alignment, "FOLD_TARGET", fold)
        if fold and on:
            monkeypatch.setattr(alignment, "_reduced_clone", None)
        cfg = config(stores, tmp_path / name, *SETS, "train.steps=1", *extra, f"mixing.doge.one_pass={str(on).lower()}")
        trainer = stages.proxy_trainer(cfg)
        calls.clear()
        runs[name] = (fit_capturing_gradients(trainer), read_history(tmp_path / name), losses(tmp_path / name))
    assert calls == [rows]  # the folded run's step: one pass
    want_grads, want, want_losses = runs["k-pass"]
    for name in ("unfolded", "folded"):
        grads, got, got_losses = runs[name]
        assert [r["step"] for r in got] == [r["step"] for r in want] == [1]
        assert got_losses == pytest.approx(want_losses, rel=1e-5)
        for a, b in zip(want, got):
            assert b["alignment"] == pytest.approx(a["alignment"], rel=1e-5, abs=1e-12)
            assert b["weights"] == pytest.approx(a["weights"], rel=1e-5, abs=1e-7)
            assert b.get("grad_norm") == (None if "grad_norm" not in a else pytest.approx(a["grad_norm"], rel=1e-5))
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        for param, g in want_grads.items():
            torch.testing.assert_close(
                grads[param], g, rtol=1e-4, atol=1e-7, msg=lambda m, p=param: f"{name}: {p}: {m}"
            )
    assert max(abs(x - 1 / 3) for x in want[-1]["weights"]) > 1e-3  # the weights moved
    if "domain_grad_clip=0.05" in extra:
        assert clips and all(float(c) < 1 for c in clips)  # the target's clip binds
    if "train.global_batch_size=2" in extra:
        assert 0.0 in want[0]["alignment"]  # a domain absent from the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gram_matrix_gives_group_products_numbers(dtype):
    """`group_gram` of [G; g_T] (G [3, ...] of two parameters, one not counted): its last column
    and diagonal are `group_products`' products and norms to fp32 rounding whatever G's dtype,
    its corner ||g_T||^2, against fp64."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(3, 40, 50, generator=gen).to(dtype), torch.randn(3, 7, generator=gen).to(dtype)]
    target = [torch.randn(40, 50, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype)]
    stacked = [torch.cat([g, t[None]]) for g, t in zip(grads, target)]
    gram = alignment.group_gram(stacked, [True, False], here=True)
    want = alignment.group_products(grads, target, [True, False], norms=True, here=True)
    torch.testing.assert_close(torch.stack([gram[:3, 3], gram.diagonal()[:3]]), want, rtol=1e-5, atol=1e-9)
    t = target[0].double().reshape(-1)
    assert gram.dtype == torch.float64 and float(gram[3, 3]) == pytest.approx(float(t @ t), rel=1e-6)
    torch.testing.assert_close(gram, gram.t())
    assert not alignment.group_gram(stacked, [True, True], here=False).any()


def _dp_worker(rank: int, world: int, store: str, run: str, extra: list[str]) -> None:
    stages.train_proxy(config(Path(store), Path(run), *DP, *extra, "parallelism.dp=2"))


DP = [*SETS, "train.steps=2", "train.micro_batches=2", "mixing.doge.one_pass=true"]


@pytest.mark.parametrize(
    "extra",
    [["mixing.doge.domain_grad_clip=0.05"], ["mixing.doge.variant=paper", "mixing.doge.target_sequences=3"]],
    ids=["authors, T = 1 (rank 0 has no target row), the clips binding", "paper, T = 3 (1 and 2 rows)"],
)
def test_one_pass_under_dp2_logs_the_single_process_step(stores, tmp_path, extra):
    """The folded target's gradient G[k] summed over dp with the domains' (authors) or alone
    (paper, whose products are partial) before the norms and products: dp 2 logs the norms,
    products and weights of one process."""
    from tests.distributed import spawn

    stages.train_proxy(config(stores, tmp_path / "single", *DP, *extra))
    spawn(_dp_worker, 2, str(stores), str(tmp_path / "dp"), extra)
    want, got = read_history(tmp_path / "single"), read_history(tmp_path / "dp")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for a, b in zip(want, got):
        assert b.get("grad_norm") == (None if "grad_norm" not in a else pytest.approx(a["grad_norm"], rel=1e-5))
        assert b["alignment"] == pytest.approx(a["alignment"], rel=1e-5, abs=1e-12)
        assert b["weights"] == pytest.approx(a["weights"], abs=1e-7)


@pytest.mark.parametrize(
    ("section", "key", "value", "why"),
    [
        ("parallelism", "tp", 2, "parallelism.tp = 2"),
        ("parallelism", "pp", 2, "parallelism.pp = 2"),
        ("model", "moe", MoEConfig(), "model.moe is set"),
        ("model", "block_pattern", "MA", "model.block_pattern has Mamba blocks"),
        ("model", "fp8", Fp8Config(), "model.fp8 is set"),
    ],
)
def test_one_pass_refuses_what_it_cannot_split(stores, tmp_path, section, key, value, why):
    """Asked for (`true`): one line naming the key and the reason (the method's `check`, run
    before any stage). Left null (the default): the one pass at tp 1 without them, the k passes
    with them, and nothing refused."""
    cfg = config(stores, tmp_path / "run", *SETS, "mixing.doge.one_pass=true")
    check_layout(cfg)
    default = config(stores, tmp_path / "run", *SETS)
    assert default.mixing.doge.one_pass is None and one_pass(default) and one_pass(cfg)
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(
        ConfigError, match=rf"^mixing.doge.one_pass: .* got {why}; set mixing.doge.one_pass: false \(or null: .*\)$"
    ):
        check_layout(cfg)
    setattr(getattr(default, section), key, value)
    check_layout(default)
    assert not one_pass(default)


@needs_triton
def test_the_optimizer_takes_the_one_pass_update_unwritten_where_it_can(stores, tmp_path):
    """Where the optimizer reads autograd's gradients with its Triton kernel (bf16 parameters,
    one process; on the CPU under Triton's interpreter), DoGE's folded one pass hands it the
    domain gradients and weights (`combine_gradients`) instead of writing the update, every step.
    Against the written update made as the kernel makes it (summed in row order, rounded toward
    zero as the interpreter rounds to bf16): without clipping, the same run bit for bit (losses,
    masters), each step's reported norm (from the Gram matrix, of the exact sum) above the
    written sum's by at most that rounding, 2^-8 (on a GPU both round to nearest); with clipping,
    the first step's the same (later steps are not compared: the clip's coefficient moves with
    the norm, and Adam turns any difference in a tiny gradient's sign into lr)."""
    run_interpreted(
        textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from doremi.pipeline import stages
        from tests.runs import config
        import trainer.run.alignment as alignment
        from trainer.optim.master_weights import MasterWeightAdamW
        from trainer.records.metrics import read_jsonl

        sets = ["train.decay=constant", "train.warmup_steps=0", "checkpoint.every=0", "train.steps=3",
                "mixing.method=doge", "train.precision=bf16", "train.param_dtype=bf16"]
        offer, written = MasterWeightAdamW.combine_gradients, alignment.combine
        taken = []

        def spy(self, rows, weights, norm):
            taken.append(offer(self, rows, weights, norm))
            return taken[-1]

        def as_the_kernel(scale, g):  # sum_d w_d G[d] in fp32 in row order, rounded toward zero
            w, acc = scale.to(g.dtype), torch.zeros(g.shape[1:], dtype=torch.float32)
            for d in range(g.shape[0]):
                acc = acc + w[d].float() * g[d].float()
            return (acc.view(torch.int32) & ~0xFFFF).view(torch.float32).to(g.dtype)

        def run(name, clip, combined):
            MasterWeightAdamW.combine_gradients = spy if combined else (lambda self, rows, weights, norm: False)
            alignment.combine = written if combined else as_the_kernel
            out = Path({str(tmp_path)!r}) / name
            trainer = stages.proxy_trainer(config(Path({str(stores)!r}), out, *sets, f"train.grad_clip={{clip}}"))
            trainer.fit()
            rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
            assert trainer.optimizer.combined_steps == (3 if combined else 0), trainer.optimizer.combined_steps
            return trainer.optimizer.master_weights(), rows

        (a, a_rows), (b, b_rows) = run("combined", 0.0, True), run("written", 0.0, False)
        assert taken == [True, True, True], taken
        assert [r["loss"] for r in a_rows] == [r["loss"] for r in b_rows]
        for n, w in b.items():
            assert torch.equal(a[n], w), n
        for ra, rb in zip(a_rows, b_rows, strict=True):
            assert 0 <= ra["grad_norm"] - rb["grad_norm"] <= 2.0**-8 * rb["grad_norm"], (ra, rb)
        (_, c_rows), (_, d_rows) = run("combined_clip", 0.5, True), run("written_clip", 0.5, False)
        c, d = c_rows[0]["grad_norm"], d_rows[0]["grad_norm"]
        assert d > 0.5 and 0 <= c - d <= 2.0**-8 * d, (c, d)
        assert c_rows[0]["loss"] == d_rows[0]["loss"]
        print("ok")
        """)
    )
