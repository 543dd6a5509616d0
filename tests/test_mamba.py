"""Mamba-2 blocks and hybrid Mamba/attention models (issue 25).

- the chunked scan (`trainer.model.mamba.ssd.ssd_chunked`) equals the token-by-token recurrence in fp32
  to 1e-5, forward and gradients, for several chunk sizes and lengths not multiples of the chunk;
- the mixer is causal, its convolution and gated norm match their definitions, and the model's
  parameter count is the formula's (`trainer.model.flops`);
- a hybrid trains the same under tp2 x dp4, pp2 x dp4 and tp2 x pp2 x dp2 (sequence parallel,
  recompute) as in one process (1e-5 over 3 steps, checkpoints resharded into one process), and
  a hybrid DoReMi proxy's weights agree to 1e-6 (one spawn of 8 gloo processes for all);
- bad Mamba config is one line naming the key; the quickstart pipeline runs with hybrid presets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from doremi.pipeline import stages
from tests.compare_runs import COMPARED, assert_same_alphas, assert_same_params
from tests.distributed import spawn
from tests.paths import QUICKSTART
from tests.runs import alphas, config, final_params, losses, run_stage
from trainer.config.mamba import layer_mixers, ssd_flops_per_token
from trainer.config.schema import model_config
from trainer.config.tools import ConfigError, from_dict
from trainer.model.flops import flops_per_token, non_embedding_params, param_count
from trainer.model.mamba.mixer import causal_depthwise_conv, gated_group_rms_norm
from trainer.model.mamba.ssd import segsum, ssd_chunked, ssd_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def scan_inputs(b: int, T: int, H: int, P: int, G: int, N: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, P, generator=gen)
    dt = F.softplus(torch.randn(b, T, H, generator=gen) - 1.0)
    A = -torch.exp(torch.rand(H, generator=gen) * math.log(16.0))
    B, C = torch.randn(b, T, G, N, generator=gen), torch.randn(b, T, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


# -- the scan ---------------------------------------------------------------------------------


def test_segsum_is_the_sum_between_positions():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = segsum(a)
    assert out[3, 1].item() == 3.0 + 4.0 and out[2, 2].item() == 0.0 and out[1, 0].item() == 2.0
    assert torch.isinf(out[0, 1]) and out[0, 1].item() < 0


@pytest.mark.parametrize(("T", "chunk"), [(13, 4), (13, 5), (16, 16), (29, 8), (7, 32), (10, 1)])
def test_chunked_scan_equals_the_recurrence_forward_and_backward(T, chunk):
    inputs = scan_inputs(2, T, H=4, P=3, G=2, N=5, seed=T * 100 + chunk)
    want = ssd_reference(*inputs)
    got = ssd_chunked(*inputs, chunk_size=chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, inputs, g)
    got_grads = torch.autograd.grad(got, inputs, g)
    for name, a, b in zip(("x", "dt", "A", "B", "C", "D"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_recurrence_by_hand_one_head_one_state():
    """h_1 = dt_1 x_1 B_1, h_2 = exp(dt_2 A) h_1 + dt_2 x_2 B_2, y_t = C_t h_t + D x_t."""
    x = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    dt = torch.tensor([0.5, 0.25]).view(1, 2, 1)
    A, D = torch.tensor([-2.0]), torch.tensor([0.5])
    B, C = torch.tensor([1.0, 4.0]).view(1, 2, 1, 1), torch.tensor([3.0, -1.0]).view(1, 2, 1, 1)
    h1 = 0.5 * 2.0 * 1.0
    h2 = math.exp(-0.5) * h1 + 0.25 * 3.0 * 4.0
    want = torch.tensor([3.0 * h1 + 0.5 * 2.0, -1.0 * h2 + 0.5 * 3.0]).view(1, 2, 1, 1)
    torch.testing.assert_close(ssd_reference(x, dt, A, B, C, D), want)
    torch.testing.assert_close(ssd_chunked(x, dt, A, B, C, D, chunk_size=1), want)


def test_causal_depthwise_conv_and_gated_norm_by_definition():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 3, 7, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    padded = F.pad(x, (3, 0))
    want = torch.stack([(padded[..., t : t + 4] * w).sum(-1) for t in range(7)], dim=-1) + bias.view(1, 3, 1)
    torch.testing.assert_close(causal_depthwise_conv(x, w, bias), want)
    y, z, weight = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(8, generator=gen)
    g = (y * F.silu(z)).view(5, 2, 4)
    want = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(5, 8) * weight
    torch.testing.assert_close(gated_group_rms_norm(y, z, weight, 4, 1e-5), want)


# -- the model --------------------------------------------------------------------------------


def test_hybrid_model_is_causal_and_chunk_size_does_not_change_it():
    from trainer.model.llama import Llama

    cfg = model_config(preset="hybrid-tiny", n_layers=4)
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    base = Llama(cfg)(None, batch).detach()
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 256
    after = Llama(cfg)(None, {"input_ids": changed, "labels": ids}).detach()
    torch.testing.assert_close(after[:, :15], base[:, :15], rtol=0, atol=0)
    assert (after[:, 15:] - base[:, 15:]).abs().max() > 1e-4
    for chunk in (1, 5, 64):
        other = model_config(preset="hybrid-tiny", n_layers=4, mamba={"chunk_size": chunk})
        torch.testing.assert_close(Llama(other)(None, batch).detach(), base, rtol=1e-5, atol=1e-5)


def test_block_pattern_tiles_and_the_counts_match_the_model():
    from trainer.model.llama import LlamaStage
    from trainer.parallel.tensor import TensorParallel

    assert layer_mixers("MA", 3) == ["mamba", "attention", "mamba"]
    assert layer_mixers("", 2) == ["attention", "attention"]
    for preset in ("hybrid-tiny", "hybrid-quickstart", "hybrid-1b"):
        cfg = model_config(preset=preset)
        stage = LlamaStage(cfg, TensorParallel(), range(cfg.n_layers), True, True, device="meta")
        assert param_count(cfg) == sum(p.numel() for p in stage.parameters()), preset
    big = model_config(preset="hybrid-1b")
    assert 1.0e9 < param_count(big) < 1.2e9
    # 16 layers M M M A: attention's 6 d s in 4 of them, the scan in the other 12
    scan = ssd_flops_per_token(big)
    assert scan == 3 * (256 * (8 * 128 + 64 * 64) + 4 * 64 * 64 * 128)
    assert flops_per_token(big, 2048) == 6 * non_embedding_params(big) + 6 * 4 * 2048 * 2048 + 12 * scan


def test_mamba_init_matches_mamba_ssm_ranges():
    from trainer.model.llama import Llama

    cfg = model_config(preset="hybrid-tiny")
    params = dict(Llama(cfg).named_parameters())
    dt = F.softplus(params["layers.0.mamba.dt_bias"])
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-6
    a = params["layers.0.mamba.A_log"].exp()
    assert a.min() >= 1.0 and a.max() <= 16.0
    assert torch.equal(params["layers.0.mamba.D"], torch.ones(8))
    assert params["layers.0.mamba.conv_weight"].abs().max() <= 0.5


@pytest.mark.parametrize(
    ("model", "tp", "match"),
    [
        ({"block_pattern": "MX"}, 1, "model.block_pattern: expected letters A"),
        ({"block_pattern": "M", "mamba": {"head_dim": 48}}, 1, "model.mamba.head_dim: expected a divisor"),
        ({"block_pattern": "M", "mamba": {"ngroups": 3}}, 1, "model.mamba.ngroups: expected a divisor"),
        (
            {"block_pattern": "M", "mamba": {"ngroups": 1}},
            2,
            "parallelism.tp: expected a divisor of model.mamba.ngroups=1",
        ),
        ({"mamba": {"d_state": 0}}, 1, "model.mamba.d_state: expected a positive int"),
    ],
)
def test_bad_mamba_config_is_one_line(model, tp, match):
    from trainer.config.schema import TrainerConfig
    from trainer.config.tools import apply_overrides

    raw: dict = {"model": {"d_model": 64, **model}, "parallelism": {"tp": tp}}
    apply_overrides(raw, ["data.domains=[{name: a, synthetic: {kind: noise, num_tokens: 100}}]"])
    with pytest.raises(ConfigError, match=match) as err:
        from_dict(TrainerConfig, raw)
    assert "\n" not in str(err.value)


# -- layouts ----------------------------------------------------------------------------------

HYBRID = ["model.preset=hybrid-tiny", "model.mamba.chunk_size=12"]  # 4 layers M A M A; 32 tokens: 12 + 12 + 8
COMMON = [*HYBRID, *COMPARED]
LAYOUTS: dict[str, list[str]] = {
    "tp2-dp4": ["parallelism.tp=2", "parallelism.dp=4"],
    "pp2-dp4-mb2": ["parallelism.pp=2", "parallelism.dp=4", "train.micro_batches=2"],
    "tp2-pp2-dp2-sp-sel": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.sequence_parallel=true",
        "parallelism.tp_async=true",
        "parallelism.recompute=selective",
        "train.micro_batches=2",
    ],
    "tp2-pp2-dp2-full": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.recompute=full",
        "parallelism.pp_schedule=afab",
        "train.micro_batches=2",
    ],
}
PROXY = ["parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2", "train.micro_batches=2"]


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mamba-layouts")
    stages.train(config(stores, root / "single", *COMMON))
    stages.train_reference(config(stores, root / "reference", *COMMON))
    proxy = [*COMMON, "train.steps=4", f"mixing.doremi.reference={root / 'reference'}"]
    stages.train_proxy(config(stores, root / "proxy-single", *proxy))
    train_jobs = [(str(root / name), [*COMMON, *sets]) for name, sets in LAYOUTS.items()]
    spawn(_run_all, 8, str(stores), train_jobs, [(str(root / "proxy-tp2-pp2-dp2"), [*proxy, *PROXY])])
    return root


def _run_all(rank: int, world: int, store: str, train_jobs: list, proxy_jobs: list) -> None:
    run_stage(rank, world, "train", store, train_jobs)
    run_stage(rank, world, "train-proxy", store, proxy_jobs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_layout_matches_single_process(runs, stores, name):
    assert len(losses(runs / name)) == 3
    assert losses(runs / name) == pytest.approx(losses(runs / "single"), rel=1e-5)
    want, got = final_params(stores, runs / "single", *HYBRID), final_params(stores, runs / name, *HYBRID)
    assert any(".mamba.A_log" in p for p in want)
    assert_same_params(got, want)


def test_hybrid_doremi_weights_do_not_depend_on_layout(runs):
    assert_same_alphas(alphas(runs / "proxy-single"), alphas(runs / "proxy-tp2-pp2-dp2"), 4, moved=1e-3)


# -- the quickstart with hybrid presets -------------------------------------------------------


def test_quickstart_pipeline_runs_hybrid_proxy_and_main(tmp_path):
    from doremi.pipeline.pipeline import Pipeline
    from trainer.records.metrics import read_jsonl

    sets = [
        "model.preset=hybrid-quickstart",
        "model.d_model=32",
        "model.n_layers=2",
        "model.ffn_dim=64",
        "model.mamba.head_dim=16",
        "pipeline.main.model.preset=hybrid-quickstart",
        "pipeline.main.model.block_pattern=MMA",
        "pipeline.main.model.d_model=48",
        "pipeline.main.model.n_layers=3",
        "pipeline.main.model.ffn_dim=96",
        "pipeline.main.model.mamba.head_dim=16",
        "pipeline.methods=[doremi, odm]",
        "pipeline.baselines=[uniform]",
        "train.steps=4",
        "train.eval_every=4",
        "train.eval_sequences=16",
        "pipeline.main.train.steps=2",
        "logging.progress=false",
        "checkpoint.every=0",
        f"pipeline.run_dir={tmp_path / 'run'}",
        f"data.store_dir={tmp_path / 'stores'}",
    ]
    Pipeline(QUICKSTART, sets, say=lambda _: None).run()
    run = tmp_path / "run"
    assert (run / "weights.json").exists()
    for mixture in ("doremi", "odm", "uniform"):
        rows = [r for r in read_jsonl(run / "main" / mixture / "metrics.jsonl") if "val_loss" in r]
        assert rows[-1]["step"] == 2 and all(math.isfinite(v) for v in rows[-1]["val_loss"].values())
    saved = (run / "main" / "doremi" / "config.yaml").read_text()
    assert "block_pattern: MMA" in saved
