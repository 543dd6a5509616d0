"""What the online reference does per step beyond its forward (doremi/methods/reference.py;
docs/design.md section 4, "The online reference's cost"): under autocast its linears' weights are
kept in bf16 once, with the same losses to the bit; the opt-in FP8 forward
(`mixing.doremi.reference_fp8`, `fp8_reference`): which linears it puts in FP8, that the reference
losses are those of FP8 GEMMs (against fake-quantised products written here, independent of
torchao's casts), that they move only slightly, and its config errors. FP8 runs in torchao's
emulation on the CPU; the tests that need it are skipped without torchao."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from doremi.methods.doremi.config import DoReMiConfig
from doremi.methods.reference import OnlineReference, fp8_reference, freeze, matmul_weights_in
from tests.scripts import bench_module
from trainer.build import RunFacts
from trainer.config.fp8 import Fp8Config, torchao_version
from trainer.config.moe import MoEConfig
from trainer.config.schema import ModelConfig, TrainConfig, TrainerConfig
from trainer.config.tools import ConfigError
from trainer.model.llama import Llama
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import forward_only

needs_torchao = pytest.mark.skipif(torchao_version() is None, reason="FP8 runs on torchao: pip install -e '.[fp8]'")

CFG = ModelConfig(vocab_size=250, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)
FP8_LINEARS = (".attn.qkv", ".attn.out", ".mlp.gate_up", ".mlp.down")
PATH = "mixing.doremi.reference_fp8"


def with_model(model: ModelConfig) -> TrainerConfig:
    return TrainerConfig(model=model)


def random_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """`rows` sequences of 16 random token ids below the tokenizer's 250, labels likewise."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 250, (rows, 16), generator=g),
        "labels": torch.randint(0, 250, (rows, 16), generator=g),
    }


def test_every_linear_with_an_fp8_path_goes_to_fp8_and_a_reference_trained_in_fp8_keeps_its_own():
    dense = fp8_reference(with_model(CFG), PATH).model
    assert dense.fp8 == Fp8Config(layers=["qkv", "proj", "gate_up", "down"])
    assert dense.fp8.scaling == "tensorwise" and dense.fp8.amax_history == 0
    assert dataclasses.replace(dense, fp8=None) == CFG
    moe = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, top_k=2))
    assert fp8_reference(with_model(moe), PATH).model.fp8.layers == ["qkv", "proj"]
    mamba = dataclasses.replace(CFG, block_pattern="M")
    assert fp8_reference(with_model(mamba), PATH).model.fp8.layers == ["gate_up", "down"]
    own = dataclasses.replace(CFG, fp8=Fp8Config(layers=["down"], scaling="rowwise", grad_dtype="e4m3"))
    cfg = with_model(own)
    assert fp8_reference(cfg, PATH) is cfg


def test_a_reference_without_a_linear_that_fp8_covers_is_a_one_line_error():
    none = dataclasses.replace(CFG, block_pattern="M", moe=MoEConfig(num_experts=4, top_k=2))
    with pytest.raises(ConfigError, match=f"^{PATH}: the reference model has no linear with an FP8 path"):
        fp8_reference(with_model(none), PATH)


def test_fp8_with_a_cache_or_without_torchao_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"^mixing\.doremi\.reference_fp8: applies to the online reference"):
        DoReMiConfig(reference_fp8=True, reference_cache="cache").validate()
    monkeypatch.setattr("trainer.config.fp8.torchao_version", lambda: None)
    with pytest.raises(ConfigError, match=r"^mixing\.doremi\.reference_fp8: FP8 linears run on torchao"):
        DoReMiConfig(reference_fp8=True).validate()
    DoReMiConfig().validate()  # off: torchao is not needed


def fake_quantise(t: torch.Tensor) -> torch.Tensor:
    """t through e4m3 and back with torchao's tensorwise dynamic scale, fp8_max / amax."""
    m = torch.finfo(torch.float8_e4m3fn).max
    s = (m / t.detach().abs().amax().double().clamp(min=1e-12)).float()
    return (t * s).clamp(-m, m).to(torch.float8_e4m3fn).float() / s


def reference_losses(model_cfg: ModelConfig, batch: dict, prepare=None) -> torch.Tensor:
    pc = ParallelContext.single()
    facts = RunFacts.resolve(with_model(model_cfg), pc)
    model = freeze(Llama(model_cfg, seed=4), facts)
    if prepare is not None:
        prepare(model)
    b = dict(batch)
    OnlineReference(model, facts, pc)(1, [b])
    return b["ref_loss"]


def fake_quantised_linears(model: torch.nn.Module) -> None:
    """Every linear `fp8_reference` names multiplies fake-quantised weights and inputs."""
    for name, module in model.named_modules():
        if name.endswith(FP8_LINEARS):
            module.weight.data = fake_quantise(module.weight.data)
            module.register_forward_pre_hook(lambda _, args: (fake_quantise(args[0]), *args[1:]))


@needs_torchao
def test_fp8_reference_losses_are_fp8_products_and_close_to_the_references():
    batch = random_batch(3, seed=0)
    fp8 = reference_losses(fp8_reference(with_model(CFG), PATH).model, batch)
    want = reference_losses(CFG, batch, fake_quantised_linears)
    plain = reference_losses(CFG, batch)
    assert fp8.dtype == torch.float32 and fp8.shape == (3, 16)
    torch.testing.assert_close(fp8, want, rtol=0, atol=2e-5)
    diff = (fp8 - plain).abs()
    assert 1e-4 < float(diff.max()) < 2e-2, float(diff.max())


def test_the_bench_times_the_fp8_row_only_where_fp8_runs_natively():
    sb = bench_module("step_bench")
    assert sb.fp8_reference_runs(torch.device("cpu")) is False
    assert "doremi-online-fp8" in sb.COST


def test_under_autocast_the_linears_weights_are_kept_in_bf16_with_the_same_losses_to_the_bit():
    """fp32 parameters computing in bf16 (`train.param_dtype: fp32`, `precision: bf16`): the
    reference's linears are stored in bf16 once instead of cast at every forward; norms and the
    embedding stay fp32, and the losses equal those of the fp32 model under autocast exactly."""
    for tie in (False, True):
        model_cfg = dataclasses.replace(CFG, tie_embeddings=tie)
        cfg = TrainerConfig(model=model_cfg, train=TrainConfig(precision="bf16", param_dtype="fp32"))
        pc = ParallelContext.single()
        facts = RunFacts.resolve(cfg, pc)
        assert facts.param_dtype == torch.float32 and isinstance(facts.autocast(), torch.autocast)
        batch = random_batch(2, seed=5)
        fp32 = freeze(Llama(model_cfg, seed=6), facts)
        with torch.no_grad(), facts.autocast():
            (want,) = forward_only(fp32, [batch], pc)
        frozen = freeze(Llama(model_cfg, seed=6), facts)
        b = dict(batch)
        OnlineReference(frozen, facts, pc)(1, [b])
        dtypes = {n: p.dtype for n, p in frozen.named_parameters()}
        linears = [n for n in dtypes if n.removesuffix(".weight").endswith(FP8_LINEARS) or n == "head.weight"]
        assert len(linears) == 4 * CFG.n_layers + (0 if tie else 1)
        assert all((dtypes[n] == torch.bfloat16) == (n in linears) for n in dtypes), dtypes
        torch.testing.assert_close(b["ref_loss"], want, rtol=0, atol=0)
        assert matmul_weights_in(frozen, torch.bfloat16) == 0


def test_without_autocast_the_reference_keeps_its_parameters_as_they_are():
    pc = ParallelContext.single()
    for train in (TrainConfig(), TrainConfig(precision="bf16")):
        facts = RunFacts.resolve(TrainerConfig(model=CFG, train=train), pc)
        frozen = freeze(Llama(CFG, seed=6), facts)
        OnlineReference(frozen, facts, pc)
        assert {p.dtype for p in frozen.parameters()} == {facts.param_dtype}


ROWWISE = Fp8Config(scaling="rowwise", grad_dtype="e4m3")


@needs_torchao
@pytest.mark.parametrize(
    "train", [TrainConfig(), TrainConfig(precision="bf16", param_dtype="fp32")], ids=["fp32", "autocast"]
)
@pytest.mark.parametrize("own", [None, ROWWISE], ids=["reference_fp8", "trained rowwise"])
def test_fp8_weights_cast_once_give_the_per_forward_casts_losses_to_the_bit(train, own):
    """`OnlineReference` casts each FP8 linear's frozen weight to FP8 once (`fp8_weights_once`,
    after `matmul_weights_in` under autocast): the losses equal those of the same model casting
    its weights at every forward, for `reference_fp8`'s tensorwise recipe and for a reference
    that trained with rowwise scaling (power-of-two scales per output feature)."""
    model_cfg = fp8_reference(with_model(dataclasses.replace(CFG, fp8=own)), PATH).model
    cfg = TrainerConfig(model=model_cfg, train=train)
    pc = ParallelContext.single()
    facts = RunFacts.resolve(cfg, pc)
    batch = random_batch(2, seed=7)
    per_forward = freeze(Llama(model_cfg, seed=8), facts)
    with torch.no_grad(), facts.autocast():
        (want,) = forward_only(per_forward, [batch], pc)
    frozen = freeze(Llama(model_cfg, seed=8), facts)
    ref = OnlineReference(frozen, facts, pc)
    b = dict(batch)
    ref(1, [b])
    linears = [m for m in frozen.modules() if getattr(m, "fp8", None) is not None]
    assert len(linears) == 4 * CFG.n_layers and all(m.fp8.frozen_weight_t is not None for m in linears)
    assert all(getattr(m, "fp8", None) is None or m.fp8.frozen_weight_t is None for m in per_forward.modules())
    torch.testing.assert_close(b["ref_loss"], want, rtol=0, atol=0)
    for m in linears:  # the forward reads the FP8 copies, not the weights
        m.weight.data.zero_()
    again = dict(batch)
    ref(2, [again])
    torch.testing.assert_close(again["ref_loss"], want, rtol=0, atol=0)


@needs_torchao
def test_only_a_whole_tp1_fp8_linear_casts_its_weight_once():
    from trainer.model.fp8 import COLUMN, Fp8Matmul
    from trainer.parallel.tensor import TensorParallel

    delayed = Fp8Matmul(COLUMN, TensorParallel(), "tensorwise", "e5m2", amax_history=4)
    with pytest.raises(ValueError, match="only a tp-1 linear with dynamic scaling"):
        delayed.freeze_weight(torch.ones(16, 16))
