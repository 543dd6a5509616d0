"""FP8 linears (trainer/model/fp8.py, on torchao's float8 training), in torchao's emulation on
the CPU: the three GEMMs of a linear against a fake-quantised reference written here, torchao's
own linear at tp 1 against the tp path's GEMMs, no graph break under dynamo, delayed scaling,
config errors (torchao missing included), and the trainer with FP8 under pp / recompute / tp /
sp / dp against one process with the same config. Skipped without torchao (`.[fp8]`, in `.[test]`).

Tolerances. Each linear's GEMMs at tp2 equal one process to 1e-5 (the amaxes over split dims
are max-reduced over tp, so every element is quantised with the single-process scale to the
single-process FP8 value; only the fp32 summation order differs), and differ by > 1e-2 with
per-shard tensorwise amaxes instead. Whole runs: the first step's loss to 1e-6, then LOSS_RTOL
and UPDATE_RTOL (see there): FP8's rounding is discontinuous, so the fp32 reorderings any layout
makes flip a few elements to the neighbouring FP8 value, and those flips are what the looser
tolerance covers, not a layout error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.compare_runs import COMPARED
from tests.distributed import spawn
from tests.runs import config, final_params, losses, run_stage
from trainer.config.fp8 import Fp8Config, torchao_version
from trainer.config.tools import ConfigError
from trainer.model.fp8 import COLUMN, ROW, Fp8Matmul, end_fp8_step
from trainer.parallel.context import ParallelContext
from trainer.parallel.tensor import TensorParallel, column_parallel_linear, row_parallel_linear

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(torchao_version() is None, reason="model.fp8 runs on torchao: pip install -e '.[fp8]'"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# -- a reference quantiser, independent of torchao ----------------------------------------------


def fake_quantise(t: torch.Tensor, dtype, scaling: str = "tensorwise", dim: int = -1, pow2: bool = False):
    """t through FP8 and back (fp32) with a dynamic scale fp8_max / amax (tensorwise, or amax
    over `dim`), rounded down to a power of two for torchao's rowwise recipe; saturating."""
    a = t.detach().abs().amax() if scaling == "tensorwise" else t.detach().abs().amax(dim=dim, keepdim=True)
    m = torch.finfo(dtype).max
    s = (m / a.double().clamp(min=1e-12)).float()
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return (t.float() * s).clamp(-m, m).to(dtype).float() / s


def test_reference_quantiser_error_is_within_half_an_fp8_step():
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    for dtype, mantissa in ((E4M3, 3), (E5M2, 2)):
        y = fake_quantise(x, dtype)
        big = x.abs() > x.abs().amax() / 64  # normal range of the scaled values
        rel = ((y - x).abs() / x.abs())[big]
        assert float(rel.max()) <= 2.0 ** -(mantissa + 1) + 1e-7
        assert float(rel.max()) > 2.0 ** -(mantissa + 3)  # it does quantise


# -- the three GEMMs against fake-quantised reference products ----------------------------------


def _fq_rows(t: torch.Tensor, dtype, scaling: str, dim: int) -> torch.Tensor:
    return fake_quantise(t, dtype, scaling, dim, pow2=scaling == "rowwise")


@pytest.mark.parametrize("scaling,grad", [("tensorwise", "e5m2"), ("rowwise", "e4m3")])
@pytest.mark.parametrize("style", [COLUMN, ROW])
def test_linear_gemms_equal_fake_quantised_products(scaling, grad, style):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, generator=gen, requires_grad=True)
    w = torch.randn(16, 32, generator=gen, requires_grad=True)
    g = torch.randn(4, 3, 16, generator=gen)
    tp = TensorParallel()
    mm = Fp8Matmul(style, tp, scaling, grad)
    linear = column_parallel_linear if style == COLUMN else row_parallel_linear
    y = linear(x, w, tp, mm)
    y.backward(g)
    gdt = E5M2 if grad == "e5m2" else E4M3
    xf, gf = x.detach().reshape(-1, 32), g.reshape(-1, 16)
    # forward x W^T: x per token (over in), W per output row (over in)
    want_y = _fq_rows(xf, E4M3, scaling, 1) @ _fq_rows(w.detach(), E4M3, scaling, 1).t()
    # input gradient g W: g per token (over out), W per input column (over out)
    want_gx = _fq_rows(gf, gdt, scaling, 1) @ _fq_rows(w.detach(), E4M3, scaling, 0)
    # weight gradient g^T x: g per output feature (over tokens), x per input feature (over tokens)
    want_gw = _fq_rows(gf, gdt, scaling, 0).t() @ _fq_rows(xf, E4M3, scaling, 0)
    torch.testing.assert_close(y.detach().reshape(-1, 16), want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.reshape(-1, 32), want_gx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-6, atol=1e-6)
    exact = x.detach() @ w.detach().t()
    assert 1e-4 < float((y.detach() - exact).abs().max() / exact.abs().max()) < 0.1  # quantised, and close


def test_tp1_linear_is_torchaos_own_and_equals_the_tp_path_gemms():
    """At tp 1 with dynamic scaling the linear is torchao's `matmul_with_hp_or_float8_args`
    (`Fp8Matmul.whole`); the GEMMs the tp path builds from torchao's casts with our amaxes give
    the same output and gradients exactly (one implementation of the quantisation, two callers)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 32, generator=gen, requires_grad=True)
    w = torch.randn(48, 32, generator=gen, requires_grad=True)
    g = torch.randn(8, 2, 48, generator=gen)
    tp = TensorParallel()
    for scaling, grad in (("tensorwise", "e5m2"), ("tensorwise", "e4m3"), ("rowwise", "e4m3")):
        mm = Fp8Matmul(COLUMN, tp, scaling, grad)
        assert mm.whole and mm._linear is matmul_with_hp_or_float8_args
        x.grad = w.grad = None
        y = column_parallel_linear(x, w, tp, mm)
        y.backward(g)
        assert torch.equal(y.detach(), mm.forward(x.detach(), w.detach()))
        assert torch.equal(x.grad, mm.grad_input(g, w.detach()))
        assert torch.equal(w.grad, mm.grad_weight(g, x.detach()))
    assert not Fp8Matmul(COLUMN, tp, "tensorwise", "e5m2", amax_history=2).whole  # delayed: the eager tp path


@pytest.mark.parametrize("scaling,grad", [("tensorwise", "e5m2"), ("rowwise", "e4m3")])
def test_fp8_linears_compile_without_graph_breaks(scaling, grad):
    """An attention-shaped block of FP8 linears at tp 1 traced by dynamo (the `aot_eager` backend,
    so AOTAutograd traces the backward too): one graph, no break, and the same numbers as eager."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 2, 32, generator=gen, requires_grad=True)
    w1, w2 = torch.randn(64, 32, generator=gen), torch.randn(32, 64, generator=gen)
    w1.requires_grad_(), w2.requires_grad_()
    tp = TensorParallel()
    col, row = Fp8Matmul(COLUMN, tp, scaling, grad), Fp8Matmul(ROW, tp, scaling, grad)

    def block(x):
        return row_parallel_linear(torch.nn.functional.silu(column_parallel_linear(x, w1, tp, col)), w2, tp, row)

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    got.sum().backward()
    grads = (x.grad.clone(), w1.grad.clone())
    x.grad = w1.grad = w2.grad = None
    want = block(x)
    want.sum().backward()
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(got, want) and torch.equal(grads[0], x.grad) and torch.equal(grads[1], w1.grad)
    torch._dynamo.reset()


def test_native_gemms_only_where_the_device_has_them_and_the_weight_dims_align(monkeypatch):
    """`torch._scaled_mm` needs compute capability >= 8.9 and dims that are multiples of 16: on
    such a device a linear whose local weight is not aligned keeps torchao's emulation, and on any
    other device every linear emulates."""
    from trainer.config.schema import ModelConfig
    from trainer.model import fp8 as fp8_model
    from trainer.model.llama import Llama

    shape = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 36}
    model = Llama(ModelConfig(**shape, fp8=Fp8Config()))
    monkeypatch.setattr(fp8_model, "native_fp8", lambda device: device.type == "cuda")
    assert fp8_model.apply_fp8(model, Fp8Config(), torch.device("cuda")) == 4
    native = {n: m.fp8.native for n, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert native == {  # ffn 36: gate_up [72, 32] and down [32, 36] are not multiples of 16
        "layers.0.attn.qkv": True,
        "layers.0.attn.out": True,
        "layers.0.mlp.gate_up": False,
        "layers.0.mlp.down": False,
    }
    assert {m.fp8.mm_config.output.emulate for m in model.modules() if getattr(m, "fp8", None)} == {False, True}
    fp8_model.apply_fp8(model, Fp8Config(), torch.device("cpu"))
    assert not any(m.fp8.native for m in model.modules() if getattr(m, "fp8", None) is not None)


def test_delayed_scaling_uses_the_history_max_and_rolls_per_step():
    tp = TensorParallel()
    mm = Fp8Matmul(COLUMN, tp, "tensorwise", "e5m2", amax_history=2)
    lin = torch.nn.Module()
    lin.fp8 = mm
    w = torch.ones(8, 16)
    x1 = torch.full((2, 16), 2.0)
    mm.forward(x1, w)  # step 1: no history, dynamic (amax 2)
    end_fp8_step(lin, ParallelContext.single())
    assert mm.delayed.history["x"].tolist() == [2.0, 0.0]
    x2 = torch.full((2, 16), 0.5)
    y = mm.forward(x2, w)  # scale from amax 2: 0.5 is exact either way; recorded amax 0.5
    assert torch.equal(y, torch.full((2, 8), 8.0))
    y_again = mm.forward(x2, w)  # a recomputed forward in the same step: same scale
    assert torch.equal(y, y_again)
    end_fp8_step(lin, ParallelContext.single())
    assert mm.delayed.history["x"].tolist() == [0.5, 2.0]
    assert float(mm.delayed.amax("x")) == 2.0
    x3 = torch.full((2, 16), 1000.0)  # beyond the history's amax: saturates at 448 / scale = 2
    assert torch.equal(mm.forward(x3, w), torch.full((2, 8), 32.0))


def test_delayed_histories_record_training_gemms_through_the_linear_not_evaluation():
    """Through the autograd Function (where grad mode is always off), a training forward and
    backward record all three roles; a forward under no_grad records none."""
    tp = TensorParallel()
    mm = Fp8Matmul(COLUMN, tp, "tensorwise", "e5m2", amax_history=2)
    lin = torch.nn.Module()
    lin.fp8 = mm
    w = torch.full((8, 16), 0.25, requires_grad=True)
    with torch.no_grad():
        column_parallel_linear(torch.full((2, 16), 3.0), w, tp, mm)
    assert mm.delayed.pending == {}
    column_parallel_linear(torch.full((2, 16), 2.0), w, tp, mm).sum().backward()
    assert {r: float(a) for r, a in mm.delayed.pending.items()} == {"x": 2.0, "w": 0.25, "g": 1.0}
    end_fp8_step(lin, ParallelContext.single())
    with torch.no_grad():
        column_parallel_linear(torch.full((2, 16), 3.0), w, tp, mm)  # scaled from the history, not recorded
    assert mm.delayed.pending == {}


def test_config_errors_name_the_key():
    with pytest.raises(
        ConfigError, match=r"model.fp8.layers: expected a non-empty list of qkv, proj, gate_up, down, head, got"
    ):
        Fp8Config(layers=["qkv", "embed"]).validate()
    with pytest.raises(ConfigError, match=r"model.fp8.amax_history: rowwise scaling is dynamic"):
        Fp8Config(scaling="rowwise", grad_dtype="e4m3", amax_history=4).validate()
    with pytest.raises(ConfigError, match=r"model.fp8.grad_dtype: rowwise scaling needs e4m3"):
        Fp8Config(scaling="rowwise").validate()
    with pytest.raises(ConfigError, match=r"model.fp8.amax_history: expected >= 0"):
        Fp8Config(amax_history=-1).validate()


def test_model_fp8_without_torchao_is_refused_with_what_to_install(monkeypatch):
    """torchao is an optional dependency: `model.fp8` without it (or with a release whose float8
    internals differ) is one ConfigError line naming the extra, at config time."""
    from trainer.config import fp8 as fp8_config

    monkeypatch.setattr(fp8_config, "torchao_version", lambda: None)
    with pytest.raises(
        ConfigError,
        match=r"^model.fp8: FP8 linears run on torchao's float8 training, which is not installed: "
        r"pip install -e '\.\[fp8\]' \(torchao>=0.18,<0.19\)$",
    ):
        Fp8Config().validate()
    monkeypatch.setattr(fp8_config, "torchao_version", lambda: "0.13.0+cu126")
    with pytest.raises(ConfigError, match=r"^model.fp8: FP8 linears need torchao 0.18.x, found torchao 0.13.0\+cu126"):
        Fp8Config().validate()
    monkeypatch.setattr(fp8_config, "torchao_version", lambda: "0.18.1")
    Fp8Config().validate()


def test_fp8_layers_the_model_lacks_are_refused_not_skipped():
    """MoE experts have no FP8 path, and a model without attention no qkv: refused in one line
    rather than FP8 silently applied to some blocks only (or none)."""
    from trainer.config.moe import MoEConfig
    from trainer.config.schema import ModelConfig

    moe = ModelConfig(moe=MoEConfig(num_experts=4, layers=[1]), fp8=Fp8Config(layers=["qkv", "gate_up"]))
    with pytest.raises(
        ConfigError, match=r"^model.fp8.layers: the MoE experts' grouped GEMMs have no FP8 path, so \['gate_up'\]"
    ):
        moe.validate()
    ModelConfig(moe=MoEConfig(num_experts=4), fp8=Fp8Config(layers=["qkv", "proj"])).validate()
    mamba = ModelConfig(block_pattern="M", fp8=Fp8Config(layers=["qkv", "down"]))
    with pytest.raises(
        ConfigError, match=r"^model.fp8.layers: \['qkv'\] are attention linears and model.block_pattern 'M'"
    ):
        mamba.validate()
    ModelConfig(block_pattern="MA", fp8=Fp8Config(layers=["qkv", "down"])).validate()


def test_only_the_named_linears_run_in_fp8_and_state_dict_is_unchanged():
    from trainer.config.schema import ModelConfig
    from trainer.model.llama import Llama

    shape = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
    plain = Llama(ModelConfig(**shape))
    fp8 = Llama(ModelConfig(**shape, fp8=Fp8Config(layers=["qkv", "down"])))
    with_fp8 = sorted(n for n, m in fp8.named_modules() if getattr(m, "fp8", None) is not None)
    assert with_fp8 == ["layers.0.attn.qkv", "layers.0.mlp.down", "layers.1.attn.qkv", "layers.1.mlp.down"]
    assert plain.state_dict().keys() == fp8.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(fp8.state_dict()[k], v)


@pytest.mark.parametrize("tie,mup", [(False, False), (True, False), (True, True)])
def test_fp8_head_is_the_heads_matmul_on_the_weight_it_reads_at_each_forward(tie, mup):
    """`head` in `model.fp8.layers`: the logits are the FP8 product of the final norm's output
    (times muP's logit multiplier) and the head's weight, the embedding matrix when tied, cast
    from that weight at every forward (no second copy: a changed weight changes the next logits);
    the parameters and the state dict are the model's without it."""
    from trainer.config.mup import MupConfig
    from trainer.config.schema import ModelConfig
    from trainer.model.fp8 import fp8_matmuls
    from trainer.model.llama import Llama
    from trainer.parallel.tied import head_weight

    shape = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
    common = {**shape, "tie_embeddings": tie, "mup": MupConfig(base_width=16) if mup else None}
    model = Llama(ModelConfig(**common, fp8=Fp8Config(layers=["down", "head"])))
    plain = Llama(ModelConfig(**common, fp8=Fp8Config(layers=["down"])))
    assert plain.head_fp8 is None and model.head_fp8.style == COLUMN and model.head_fp8.whole
    assert len(fp8_matmuls(model)) == len(fp8_matmuls(plain)) + 1 == 3
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert ("head.weight" in dict(model.named_parameters())) is not tie
    assert model.logit_scale == (0.5 if mup else 1.0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.hidden(None, {"input_ids": ids})
        h = (model.norm(x) * model.logit_scale).reshape(-1, 32)
        for scale in (1.0, 3.0):
            head_weight(model).mul_(scale)
            w = head_weight(model)
            got = model._local_logits(x).reshape(-1, w.shape[0])
            torch.testing.assert_close(got, fake_quantise(h, E4M3) @ fake_quantise(w, E4M3).t(), rtol=1e-6, atol=1e-6)
            exact = h @ w.t()
            assert 1e-4 < float((got - exact).abs().max() / exact.abs().max()) < 0.1


def test_fp8_head_keeps_its_delayed_history_under_its_name():
    from trainer.config.schema import ModelConfig
    from trainer.model.fp8 import amax_histories
    from trainer.model.llama import Llama

    shape = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
    model = Llama(ModelConfig(**shape, fp8=Fp8Config(layers=["qkv", "head"], amax_history=2)))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(None, {"input_ids": ids, "labels": ids}).mean().backward()
    end_fp8_step(model, ParallelContext.single())
    histories = amax_histories(model, ParallelContext.single())
    assert sorted(histories) == ["head", "layers.0.attn.qkv"]
    assert histories["head"]["steps"] == 1 and sorted(histories["head"]["history"]) == ["g", "w", "x"]


# -- the trainer under layouts ------------------------------------------------------------------

TIED = "model.tie_embeddings=true"
WITH_HEAD = "model.fp8.layers=[qkv,proj,gate_up,down,head]"
FP8 = {
    "tensorwise": ["model.fp8.layers=[qkv,proj,gate_up,down]"],
    "rowwise": ["model.fp8.scaling=rowwise", "model.fp8.grad_dtype=e4m3"],
    "delayed": ["model.fp8.amax_history=4"],
    "head": [WITH_HEAD],
    "tensorwise-tied": [TIED, "model.fp8.layers=[qkv,proj,gate_up,down]"],
    "head-tied": [TIED, WITH_HEAD],
}


def model_sets(fp8: str) -> list[str]:
    """An FP8 variant's architecture keys beyond the test model's (loading a checkpoint checks them)."""
    return [s for s in FP8[fp8] if s == TIED]


def plain_run(fp8: str) -> str:
    """The single-process run in high precision that an FP8 variant is compared with."""
    return "single-plain" + ("-tied" if model_sets(fp8) else "")


#: Pipeline stages with full / selective recompute, 1F1B / AFAB, without tp.
PIPELINE: dict[str, tuple[str, list[str]]] = {
    "tensorwise-pp4-1f1b-full": (
        "tensorwise",
        ["parallelism.pp=4", "parallelism.recompute=full", "parallelism.pp_schedule=1f1b", "train.micro_batches=4"],
    ),
    "delayed-pp4-afab-full": (
        "delayed",
        ["parallelism.pp=4", "parallelism.recompute=full", "parallelism.pp_schedule=afab", "train.micro_batches=4"],
    ),
    "rowwise-pp4-1f1b-selective": (
        "rowwise",
        ["parallelism.pp=4", "parallelism.recompute=selective", "train.micro_batches=4"],
    ),
}
#: tp with sequence parallel, async, recomputed all-gather, recompute, pp, dp + ZeRO-1.
TP: dict[str, tuple[str, list[str]]] = {
    "tensorwise-tp2-pp2-sp-1f1b-full": (
        "tensorwise",
        [
            "parallelism.tp=2",
            "parallelism.pp=2",
            "parallelism.sequence_parallel=true",
            "parallelism.recompute=full",
            "train.micro_batches=4",
        ],
    ),
    "rowwise-tp2-pp2-sp-async-rag-sel": (
        "rowwise",
        [
            "parallelism.tp=2",
            "parallelism.pp=2",
            "parallelism.sequence_parallel=true",
            "parallelism.tp_async=true",
            "parallelism.tp_recompute_allgather=true",
            "parallelism.recompute=selective",
            "train.micro_batches=4",
        ],
    ),
    "delayed-tp2-dp2-sp-zero1": (
        "delayed",
        [
            "parallelism.tp=2",
            "parallelism.dp=2",
            "parallelism.sequence_parallel=true",
            "parallelism.zero1=true",
            "train.micro_batches=2",
        ],
    ),
    "head-tp2-pp2-sp-1f1b-full": (
        "head",
        [
            "parallelism.tp=2",
            "parallelism.pp=2",
            "parallelism.sequence_parallel=true",
            "parallelism.recompute=full",
            "train.micro_batches=4",
        ],
    ),
    "head-tied-tp2-pp2-sp-async": (
        "head-tied",
        [
            "parallelism.tp=2",
            "parallelism.pp=2",
            "parallelism.sequence_parallel=true",
            "parallelism.tp_async=true",
            "train.micro_batches=4",
        ],
    ),
}


def gemm_worker(rank: int, world: int, out: str) -> None:
    """Each linear's three GEMMs at tp2 against tp1 on the same full tensors: with the amaxes
    reduced over tp (as built) and, for contrast, with per-shard amaxes."""
    import torch.distributed as dist

    pc = ParallelContext.from_process_group(2, 1, 2, torch.device("cpu"))
    tp2 = TensorParallel(size=2, rank=pc.tp_rank, group=pc.tp_group)
    tp1 = TensorParallel()
    gen = torch.Generator().manual_seed(0)
    x, w, g = (
        torch.randn(8, 2, 32, generator=gen),
        torch.randn(16, 32, generator=gen),
        torch.randn(8, 2, 16, generator=gen),
    )
    x[3, 1, 5], g[2, 0, 9] = 40.0, 30.0  # one outlier in one shard: per-shard scales differ
    r = pc.tp_rank
    worst: dict[str, float] = {}
    for scaling, grad in (("tensorwise", "e5m2"), ("rowwise", "e4m3")):
        for style, fn in ((COLUMN, column_parallel_linear), (ROW, row_parallel_linear)):
            x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
            fn(x1, w1, tp1, Fp8Matmul(style, tp1, scaling, grad)).backward(g)
            col = style == COLUMN
            want_y = fn(x, w, tp1, Fp8Matmul(style, tp1, scaling, grad)).detach()
            want_y = want_y.chunk(2, -1)[r] if col else want_y
            want_x = x1.grad if col else x1.grad.chunk(2, -1)[r]
            want_w = w1.grad.chunk(2, 0 if col else 1)[r]
            for reduced in (True, False):
                xl = (x if col else x.chunk(2, -1)[r]).clone().requires_grad_()
                wl = w.chunk(2, 0 if col else 1)[r].clone().requires_grad_()
                mm = Fp8Matmul(style, tp2 if reduced else tp1, scaling, grad)
                y = fn(xl, wl, tp2, mm)
                y.backward(g.chunk(2, -1)[r] if col else g)
                d = max(
                    float((a - b).abs().max() / b.abs().max())
                    for a, b in ((y.detach(), want_y), (xl.grad, want_x), (wl.grad, want_w))
                )
                key = f"{scaling}-{style}-{'reduced' if reduced else 'per-shard'}"
                worst[key] = max(worst.get(key, 0.0), d)
    if dist.get_rank() == 0:
        torch.save(worst, out)


def fp8_worker(rank: int, world: int, store: str, jobs: list, out: str) -> None:
    gemm_worker(rank, world, out)
    run_stage(rank, world, "train", store, jobs)


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    for name, sets in FP8.items():
        stages.train(config(stores, root / f"single-{name}", *COMPARED, *sets, "train.micro_batches=4"))
    stages.train(config(stores, root / "single-plain", *COMPARED, "train.micro_batches=4"))
    stages.train(config(stores, root / "single-plain-tied", *COMPARED, TIED, "train.micro_batches=4"))
    layouts = {**PIPELINE, **TP}
    jobs = [(str(root / name), [*COMPARED, *FP8[fp8], *sets]) for name, (fp8, sets) in layouts.items()]
    spawn(fp8_worker, 4, str(stores), jobs, str(root / "gemms.pt"))
    return root


def test_tp_gemms_equal_one_process_only_with_tp_reduced_amaxes(runs):
    """Tensorwise, a shard's own amax gives other scales and other FP8 values. Rowwise (torchao's
    recipe) rounds scales down to powers of two, and FP8 rounding is invariant under a power-of-two
    rescaling short of saturation and subnormals: per-shard scales change (almost) nothing there,
    and the tp reduction is what keeps the two scales equal at all. Differences are relative to
    the largest element of each output (an absolute 1e-5 was within one ulp of the outlier's
    products on some CPUs)."""
    worst = torch.load(runs / "gemms.pt")
    assert len(worst) == 8
    for key, d in worst.items():
        if key.endswith("reduced"):
            assert d < 1e-6, key  # the same FP8 elements; fp32 summation order only (measured <= 1.2e-7)
        elif key.startswith("tensorwise"):
            assert d > 1e-2, key


def initial_params(stores: Path, run: Path, *model_sets: str) -> dict[str, torch.Tensor]:
    from trainer.build import build_model

    model = build_model(config(stores, Path(str(run) + "-init"), *model_sets), ParallelContext.single())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def update_error(got: dict, want: dict, start: dict) -> float:
    """||got - want|| / ||want - start|| over all parameters: the layout's error relative to
    the updates the 3 steps made."""
    num = sum(float((got[p] - want[p]).pow(2).sum()) for p in want)
    den = sum(float((want[p] - start[p]).pow(2).sum()) for p in want)
    return (num / den) ** 0.5


#: FP8 rounds to a neighbouring value the few inputs that lie within fp32 rounding of an FP8
#: rounding boundary, and any reordering of fp32 sums moves some (tp splits the GEMMs' sums; even
#: the pipeline's bookkeeping differs from one process by ~1e-8 in the parameters without FP8).
#: A 1e-7 relative perturbation of the input moves a single process's tensorwise-e5m2 gradients
#: by up to 1e-1 of their max, rowwise ones by 1e-3; Adam then turns a flipped small gradient
#: element into a different step of up to 2 lr for that element. So: the first step's loss
#: (before any update) to 1e-6, the 3 steps' losses to LOSS_RTOL, and the parameters' distance
#: relative to the updates' size (`update_error`) below UPDATE_RTOL; the test prints it.
LOSS_RTOL, UPDATE_RTOL = 1e-3, 0.05


@pytest.mark.parametrize("name", [*PIPELINE, *TP])
def test_fp8_layout_matches_single_process_to_fp8_rounding(runs, stores, name):
    fp8 = {**PIPELINE, **TP}[name][0]
    got_losses, want_losses = losses(runs / name), losses(runs / f"single-{fp8}")
    assert len(got_losses) == 3
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-6)
    assert got_losses == pytest.approx(want_losses, rel=LOSS_RTOL)
    arch, plain = model_sets(fp8), runs / plain_run(fp8)
    want, got = final_params(stores, runs / f"single-{fp8}", *arch), final_params(stores, runs / name, *arch)
    err = update_error(got, want, initial_params(stores, runs / f"single-{fp8}", *arch))
    fp8_effect = update_error(final_params(stores, plain, *arch), want, initial_params(stores, plain, *arch))
    print(f"{name}: update error {err:.2e} (FP8 against fp32: {fp8_effect:.2e})")
    assert err < UPDATE_RTOL, err


def test_fp8_runs_differ_from_high_precision_but_little(runs):
    for name in FP8:
        plain, got = losses(runs / plain_run(name)), losses(runs / f"single-{name}")
        assert got != pytest.approx(plain, rel=1e-6)
        assert got == pytest.approx(plain, rel=2e-2)


def test_fp8_head_changes_the_loss_by_fp8_rounding_only(runs):
    """The same FP8 run with the LM head's GEMMs in FP8 too (`head`, opt in) against its
    high-precision head: different from the first step (the logits are quantised), and within
    the FP8 runs' tolerance of it."""
    for tied in ("", "-tied"):
        with_head, without = losses(runs / f"single-head{tied}"), losses(runs / f"single-tensorwise{tied}")
        assert with_head[0] != pytest.approx(without[0], rel=1e-6)
        assert with_head == pytest.approx(without, rel=2e-2)


# -- delayed scaling across a resume --------------------------------------------------------------


def test_delayed_scaling_resumes_exactly_from_its_saved_histories(stores, tmp_path):
    """A crash after step 3's checkpoint: the resumed steps 4-6 must scale with the amaxes of
    steps 1-3 (saved in the checkpoint), as the uninterrupted run did, not dynamically."""
    import shutil

    from trainer.checkpoint.checkpoint import checkpoint_dir

    sets = [*COMPARED, *FP8["delayed"], "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10"]
    whole = tmp_path / "whole"
    stages.train(config(stores, whole, *sets))
    crashed = tmp_path / "crashed"
    shutil.copytree(whole, crashed)
    for step in (4, 5, 6):
        shutil.rmtree(checkpoint_dir(crashed, step))
    stages.train(config(stores, crashed, *sets))
    assert losses(crashed) == losses(whole)

    extra = torch.load(checkpoint_dir(crashed, 3) / "extra.pt")
    saved = extra["fp8"]["layers.0.attn.qkv"]
    assert saved["steps"] == 3 and [len(h) for h in saved["history"].values()] == [4, 4, 4]

    from trainer.build import build_model
    from trainer.model.fp8 import load_amax_histories

    model = build_model(config(stores, crashed, *sets), ParallelContext.single())
    with pytest.raises(ConfigError, match=r"^checkpoint ck: no FP8 amax history for layers\.0\.attn\.qkv "):
        load_amax_histories(model, {}, torch.device("cpu"), "ck")  # a checkpoint written before they were saved
    short = {n: {"steps": 3, "history": {r: [1.0, 2.0] for r in "xwg"}} for n in extra["fp8"]}
    with pytest.raises(ConfigError, match="has 2 steps but model.fp8.amax_history is 4"):
        load_amax_histories(model, short, torch.device("cpu"), "ck")


def test_pipeline_checkpoint_holds_every_stage_histories(runs):
    """Rank 0 writes the extra state; the pp4 run's must hold the histories of all four stages."""
    from trainer.checkpoint.checkpoint import latest_checkpoint

    extra = torch.load(latest_checkpoint(runs / "delayed-pp4-afab-full") / "extra.pt")
    layers = {name.split(".")[1] for name in extra["fp8"]}
    assert layers == {str(i) for i in range(4)}
    assert all(state["steps"] == 3 for state in extra["fp8"].values())
