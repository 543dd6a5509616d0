"""Spectral muP (trainer/model/mup.py): the rules as numbers, the base-width model equal to the
model without muP, per-layer learning rates through both optimizers, a coordinate check (the
RMS of every layer's activations after 10 Adam steps, widths 128 to 2048), and a tp2 x pp2 run
with muP equal to one process."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.compare_runs import COMPARED, assert_same_params
from tests.distributed import spawn
from tests.runs import config, final_params, losses, run_stage
from trainer.config.mup import MupConfig
from trainer.config.schema import ModelConfig, TrainConfig
from trainer.config.tools import ConfigError
from trainer.model.init import init_parameters
from trainer.model.llama import Llama, LlamaStage
from trainer.model.mup import (
    attention_scale,
    init_multiplier,
    logit_multiplier,
    lr_multiplier,
    spectral_sigma,
)
from trainer.optim.master_weights import MasterWeightAdamW
from trainer.optim.param_groups import param_groups
from trainer.optim.sharded import ShardedOptimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.shard import get_shard_spec, unshard
from trainer.parallel.tensor import TensorParallel

pytestmark = pytest.mark.usefixtures("one_thread")


def model_cfg(d: int, base: int | None, **kw) -> ModelConfig:
    mup = MupConfig(base_width=base) if base else None
    shape = {"vocab_size": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 2 * d, "max_seq_len": 64}
    return ModelConfig(**{**shape, "d_model": d, "mup": mup, **kw})


def test_rules_as_numbers():
    assert spectral_sigma(64, 256) == pytest.approx(1 / 8)  # fan_out > fan_in: 1/sqrt(fan_in)
    assert spectral_sigma(256, 64) == pytest.approx(1 / 16 * 0.5)  # fan_out < fan_in: times sqrt(ratio)
    cfg = model_cfg(256, 64)  # r = 4
    assert init_multiplier("layers.0.attn.qkv.weight", (512, 256), cfg) == pytest.approx(0.5)
    assert init_multiplier("layers.0.mlp.down.weight", (256, 512), cfg) == pytest.approx(0.5)
    assert init_multiplier("embed.weight", (256, 256), cfg) == 1.0
    assert init_multiplier("head.weight", (256, 256), cfg) == 1.0
    assert init_multiplier("layers.0.attn_norm.weight", (256,), cfg) == 1.0
    assert lr_multiplier("layers.0.mlp.gate_up.weight", (1024, 256), cfg) == pytest.approx(0.25)
    assert lr_multiplier("embed.weight", (256, 256), cfg) == 1.0
    assert lr_multiplier("head.weight", (256, 256), cfg) == 1.0
    assert logit_multiplier(cfg) == pytest.approx(0.25)
    # MoE: each expert's slice is a hidden matrix; the router's fan_out (8 experts) is fixed
    assert init_multiplier("layers.0.mlp.experts.gate_up", (8, 1024, 256), cfg) == pytest.approx(0.5)
    assert init_multiplier("layers.0.mlp.experts.down", (8, 256, 512), cfg) == pytest.approx(0.5)
    assert lr_multiplier("layers.0.mlp.experts.down", (8, 256, 512), cfg) == pytest.approx(0.25)
    assert init_multiplier("layers.0.mlp.router.weight", (8, 256), cfg) == pytest.approx(0.25)
    assert lr_multiplier("layers.0.mlp.router.weight", (8, 256), cfg) == pytest.approx(0.25)
    # Mamba-2: the depthwise convolution's taps are per channel, not a matrix over the width
    assert init_multiplier("layers.0.mamba.conv_weight", (640, 4), cfg) == 1.0
    assert lr_multiplier("layers.0.mamba.conv_weight", (640, 4), cfg) == 1.0
    assert lr_multiplier("layers.0.mamba.in_proj.weight", (1200, 256), cfg) == pytest.approx(0.25)
    assert attention_scale(cfg) == pytest.approx(math.sqrt(16) / 64)  # head_dim 64, base 16
    assert attention_scale(model_cfg(256, 256)) == pytest.approx(1 / math.sqrt(64))
    assert attention_scale(model_cfg(256, None)) is None
    with pytest.raises(ConfigError, match=r"model.mup.base_width: expected a positive int, got 0"):
        MupConfig(base_width=0).validate()


def test_base_width_model_equals_the_model_without_mup():
    batch = {"input_ids": torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    plain, mup = Llama(model_cfg(64, None)), Llama(model_cfg(64, 64))
    for (n, p), (_, q) in zip(plain.named_parameters(), mup.named_parameters()):
        assert torch.equal(p, q), n
    torch.testing.assert_close(mup(None, batch), plain(None, batch), rtol=1e-6, atol=1e-6)
    wide = Llama(model_cfg(256, 64))
    assert float(wide.layers["0"].attn.qkv.weight.detach().std()) == pytest.approx(0.02 / 2, rel=0.05)
    assert float(wide.embed.weight.detach()[:256].std()) == pytest.approx(0.02, rel=0.05)


def test_param_groups_keep_order_and_scale_lr_in_both_optimizers():
    model = Llama(model_cfg(128, 32))  # r = 4
    named = list(model.named_parameters())
    groups = param_groups(named, 0.1)
    order = [id(p) for g in groups for p in g["params"]]
    from trainer.optim.param_groups import decay_first

    assert order == [id(p) for _, p in decay_first(named)]
    assert sorted({g["lr_scale"] for g in groups}) == [0.25, 1.0]
    train = TrainConfig(lr=1e-2, weight_decay=0.1)
    fp32 = ShardedOptimizer(named, train, ParallelContext.single(), zero1=False)
    fp32.set_lr(2e-2)
    by_param = {id(p): g["lr"] for g in fp32.param_groups for p in g["params"]}
    assert by_param[id(model.layers["0"].mlp.down.weight)] == pytest.approx(5e-3)
    assert by_param[id(model.embed.weight)] == pytest.approx(2e-2)
    assert by_param[id(model.norm.weight)] == pytest.approx(2e-2)


def test_a_hidden_matrix_decays_as_much_per_step_as_at_the_base_width():
    """microsoft/mup `MuAdam` (mup/optim.py): a matrix-like parameter's lr is divided by the width
    multiplier and its weight decay multiplied by it, so lr x weight_decay per step is the base
    width's; vectors and the embedding keep theirs, undecayed vectors stay at 0."""
    model = Llama(model_cfg(128, 32))  # r = 4
    named = list(model.named_parameters())
    decays = {id(p): (g["lr_scale"], g["weight_decay"]) for g in param_groups(named, 0.1) for p in g["params"]}
    down, embed, norm = model.layers["0"].mlp.down.weight, model.embed.weight, model.norm.weight
    assert decays[id(down)] == (0.25, pytest.approx(0.4))
    assert decays[id(embed)] == (1.0, 0.1)
    assert decays[id(norm)] == (1.0, 0.0)
    opt = MasterWeightAdamW(named, TrainConfig(lr=1e-2, weight_decay=0.1), ParallelContext.single())
    with torch.no_grad():
        before = opt.master_weights()
        for p in opt.params:
            p.grad = torch.zeros_like(p)
    opt.step(1e-2)
    after = opt.master_weights()
    for name, p in named:  # a zero gradient: the step is the decay alone, 1 - lr x wd = 0.999
        want = before[name] * (0.999 if p.ndim >= 2 else 1.0)
        torch.testing.assert_close(after[name], want, rtol=1e-6, atol=1e-7, msg=name)


def test_master_weight_adamw_applies_per_parameter_lr():
    """The bf16 master-weight optimizer against torch AdamW with the muP param groups, on the
    same (bf16-representable) gradients: the fp32 masters agree."""
    gen = torch.Generator().manual_seed(0)
    ref_model, model = Llama(model_cfg(64, 16)), Llama(model_cfg(64, 16))
    train = TrainConfig(lr=1e-2, weight_decay=0.1)
    named = list(model.named_parameters())
    opt = MasterWeightAdamW(named, train, ParallelContext.single())
    ref_named = list(ref_model.named_parameters())
    with torch.no_grad():
        start = opt.master_weights()
        for name, r in ref_named:
            r.copy_(start[name])
    groups = param_groups(ref_named, train.weight_decay)
    for g in groups:
        g["lr"] = train.lr * g["lr_scale"]
    ref = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps)
    for _ in range(2):
        for (_, r), (_, p) in zip(ref_named, named):
            grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            p.grad, r.grad = grad, grad.float()
        opt.step(train.lr)
        ref.step()
    masters = opt.master_weights()
    for name, r in ref_named:
        torch.testing.assert_close(masters[name], r.detach(), rtol=1e-6, atol=1e-6, msg=name)
    assert {g["lr_scale"] for g in groups} == {0.25, 1.0}


# -- zero init (model.mup.zero_init) -------------------------------------------------------------


def zero_cfg(**kw) -> ModelConfig:
    return model_cfg(128, 64, **kw)


def test_zero_init_zeroes_the_head_and_the_query_rows_only():
    cfg = zero_cfg()
    on_cfg = replace(cfg, mup=MupConfig(base_width=64, zero_init=True))
    off, on = dict(Llama(cfg, seed=5).named_parameters()), dict(Llama(on_cfg, seed=5).named_parameters())
    q = cfg.n_heads * cfg.head_dim  # 4 x 32 = 128 of the qkv's 128 + 2 x 64 rows
    assert on["head.weight"].shape == (256, 128) and not on["head.weight"].any()
    for name, p in off.items():
        if name.endswith("attn.qkv.weight"):
            assert on[name].shape == (256, 128) and not on[name][:q].any(), name
            assert torch.equal(on[name][q:], p[q:]) and p[:q].abs().min() > 0, name
        elif name != "head.weight":
            assert torch.equal(on[name], p), name
    assert {n for n in off if n.endswith("attn.qkv.weight")} == {"layers.0.attn.qkv.weight", "layers.1.attn.qkv.weight"}


def test_zero_init_is_the_same_model_at_tp1_and_tp2():
    """Each tp rank's slice of [q; k; v] holds its heads' q rows (zero) then its k and v rows;
    put back together (`unshard`) the ranks' tensors are the one-process model's."""
    cfg = replace(zero_cfg(), mup=MupConfig(base_width=64, zero_init=True))
    ref = dict(Llama(cfg, seed=5).named_parameters())
    ranks = []
    for rank in range(2):
        stage = LlamaStage(cfg, TensorParallel(size=2, rank=rank), range(cfg.n_layers), True, True)
        init_parameters(stage, cfg, 5, rank, 2)
        ranks.append(dict(stage.named_parameters()))
    assert set(ranks[0]) == set(ref)
    local_q = cfg.n_heads * cfg.head_dim // 2
    assert not ranks[1]["layers.0.attn.qkv.weight"][:local_q].any()
    assert ranks[1]["layers.0.attn.qkv.weight"][local_q:].abs().min() > 0
    for name, p in ref.items():
        full = unshard([r[name].detach() for r in ranks], get_shard_spec(ranks[0][name]))
        assert torch.equal(full, p.detach()), name


def test_zero_init_refuses_tied_embeddings():
    with pytest.raises(
        ConfigError,
        match=r"^model.mup.zero_init: a tied head is the embedding, which cannot start at zero; "
        r"set model.tie_embeddings=false or model.mup.zero_init=false$",
    ):
        replace(zero_cfg(), tie_embeddings=True, mup=MupConfig(base_width=64, zero_init=True)).validate()
    replace(zero_cfg(), tie_embeddings=True).validate()  # without zero_init, tied is fine


# -- coordinate check ---------------------------------------------------------------------------


def activation_rms(
    d: int, base: int | None, steps: int = 10, lr: float = 1e-2, zero_init: bool = False
) -> dict[str, float]:
    """RMS of the embedding output, each block's output and the logits after `steps` Adam steps
    on a fixed random batch (4 x 16 tokens)."""
    torch.manual_seed(0)
    cfg = model_cfg(d, base, init_std=0.02, depth_scaled_init=False)
    if zero_init:
        cfg = replace(cfg, mup=MupConfig(base_width=base, zero_init=True))
    model = Llama(cfg)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    opt = ShardedOptimizer(
        list(model.named_parameters()), TrainConfig(lr=lr, weight_decay=0.0), ParallelContext.single(), zero1=False
    )
    for _ in range(steps):
        model(None, batch).mean().backward()
        opt.step(lr)
        opt.zero_grad()
    rms: dict[str, float] = {}
    hooks = [model.embed.register_forward_hook(lambda m, i, o: rms.__setitem__("embed", float(o.pow(2).mean().sqrt())))]
    for name, block in model.layers.items():
        hook = (lambda n: lambda m, i, o: rms.__setitem__(f"block{n}", float(o.pow(2).mean().sqrt())))(name)
        hooks.append(block.register_forward_hook(hook))
    with torch.no_grad():
        rms["logits"] = float(model.logits(None, batch).pow(2).mean().sqrt())
    for h in hooks:
        h.remove()
    return rms


def test_coordinate_check_mup_keeps_activations_width_independent():
    """Widths 128 and 2048 (n_heads 4, ffn 2 d, 2 layers), 10 Adam steps at lr 1e-2. With muP
    (base width 128) every layer's activation RMS changes by less than 2x; without, the hidden
    layers and the logits change by far more."""
    narrow_mup, wide_mup = activation_rms(128, 128), activation_rms(2048, 128)
    narrow_sp, wide_sp = activation_rms(128, None), activation_rms(2048, None)
    mup_ratio = {k: max(wide_mup[k] / narrow_mup[k], narrow_mup[k] / wide_mup[k]) for k in narrow_mup}
    sp_ratio = {k: max(wide_sp[k] / narrow_sp[k], narrow_sp[k] / wide_sp[k]) for k in narrow_sp}
    assert set(mup_ratio) == {"embed", "block0", "block1", "logits"}
    assert max(mup_ratio.values()) < 2.0, mup_ratio
    assert sp_ratio["logits"] > 2.0, sp_ratio  # 3.5 measured
    assert min(sp_ratio[k] for k in ("block0", "block1")) > 100.0, sp_ratio  # > 3000 measured


def test_coordinate_check_holds_with_zero_init():
    """The same check with `model.mup.zero_init`: the zero head and queries move by the
    width-independent amounts muP gives them."""
    narrow, wide = activation_rms(128, 128, zero_init=True), activation_rms(2048, 128, zero_init=True)
    ratio = {k: max(wide[k] / narrow[k], narrow[k] / wide[k]) for k in narrow}
    assert set(ratio) == {"embed", "block0", "block1", "logits"}
    assert max(ratio.values()) < 2.0, ratio


# -- a tp2 x pp2 run with muP -------------------------------------------------------------------

MUP = ["model.mup.base_width=32", "train.micro_batches=4"]
LAYOUT = ["parallelism.tp=2", "parallelism.pp=2", "parallelism.sequence_parallel=true"]


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mup")
    stages.train(config(stores, root / "single", *COMPARED, *MUP))
    stages.train(config(stores, root / "plain", *COMPARED, "train.micro_batches=4"))
    spawn(run_stage, 4, "train", str(stores), [(str(root / "tp2-pp2-sp"), [*COMPARED, *MUP, *LAYOUT])])
    return root


def test_mup_tp2_pp2_matches_single_process(runs, stores):
    assert losses(runs / "tp2-pp2-sp") == pytest.approx(losses(runs / "single"), rel=1e-5)
    assert losses(runs / "single") != pytest.approx(losses(runs / "plain"), rel=1e-4)  # muP does change the run
    want, got = final_params(stores, runs / "single", *MUP), final_params(stores, runs / "tp2-pp2-sp", *MUP)
    assert_same_params(got, want)


def test_paths_without_the_multipliers_refuse_a_mup_model(stores, tmp_path):
    from trainer.hf.format import HFFormatError, to_hf_config
    from trainer.stacked.train import check_stackable

    cfg = config(stores, tmp_path / "run", "model.mup.base_width=32")
    with pytest.raises(ConfigError, match=r"model.mup: stacked training runs the plain Llama"):
        check_stackable(cfg)
    with pytest.raises(HFFormatError, match=r"^model.mup: a Llama config.json maps the plain Llama only, without muP"):
        to_hf_config(cfg.model, torch.float32, None)
