"""`doremi plan` plans every stage and searches the layouts: optimizer state by kind, the exact
proxy's micro-batches in flight, dp from --gpus, the 70B acceptance, what to change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from doremi.commands.cli import main
from doremi.pipeline.plan_stages import plan_groups
from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, load_config
from trainer.plan.cost_model import CostModel, bytes_per_param
from trainer.plan.memory import GIB, model_name, plan_memory

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
TINY = ModelConfig(**PRESETS["tiny"])  # h 64, f 128, kv 2 x 16, vocab 256, 2 layers


def test_adafactor_state_is_factored_and_matches_torch():
    cm = CostModel(TINY, optimizer="adafactor")
    shapes = cm.stage_tensor_shapes(0, 2)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = torch.optim.Adafactor(params, lr=1e-2)
    sum(p.sum() for p in params).backward()
    opt.step()
    stored = sum(t.numel() * t.element_size() for p in params for k, t in opt.state[p].items() if k != "step")
    # per block: 2 norms 2*64, qkv (128+64), out (64+64), gate_up (256+64), down (64+128): 4 bytes each
    block = 4 * (128 + 192 + 128 + 320 + 192)
    head = 4 * (256 + 64) * (1 if TINY.tie_embeddings else 2) + 4 * 64
    assert cm.optimizer_state_bytes(0, 2) == stored == 2 * block + head
    assert bytes_per_param("fp32", 1, True, optimizer="adafactor").optimizer == 0.0
    assert CostModel(TINY, optimizer="adamw").optimizer_state_bytes(0, 2) == 8 * cm.stage_params(0, 2)
    assert CostModel(TINY, dp=4, optimizer="adafactor").optimizer_state_bytes(0, 2) == stored / 4


def test_pile_280m_exact_proxy_holds_all_micro_batches():
    (tuning, main_group) = plan_groups(CONFIGS / "pile_280m.yaml")
    assert [n for n, _, _ in tuning.stages] == ["reference", "proxy"]
    reference, proxy = (plan_memory(cfg, 8, 80, frozen_reference=f) for _, cfg, f in tuning.stages)
    assert reference.optimizer == proxy.optimizer == "adafactor" and proxy.param_precision == "fp32"
    assert (reference.schedule, proxy.schedule) == ("1f1b", "afab")
    assert [s.memory.in_flight for s in reference.stages] == [1]
    assert [s.memory.in_flight for s in proxy.stages] == [8]
    extra = proxy.stages[0].memory.activations - reference.stages[0].memory.activations
    assert extra / GIB == pytest.approx(7 * 6.74, abs=0.1)  # about 47 GiB more
    assert proxy.stages[0].frozen == 4 * proxy.stages[0].memory.params
    (name, main_cfg, _) = main_group.stages[0]
    assert main_group.prefix == "pipeline.main." and name == "main (doremi, uniform)"
    main_plan = plan_memory(main_cfg, 8, 80)
    assert (main_plan.tp, main_plan.dp) == (4, 2)
    assert main_plan.model.startswith("custom (llama3-8b with vocab_size=256000")


def test_model_named_by_preset_only_when_dimensions_equal():
    assert model_name(ModelConfig(preset="tiny", **PRESETS["tiny"])) == "tiny"
    assert (
        model_name(ModelConfig(**{**PRESETS["tiny"], "preset": "tiny", "n_layers": 3}))
        == "custom (tiny with n_layers=3)"
    )
    assert model_name(TINY).startswith("custom (d_model=64, n_layers=2")


def _plan(capsys, *argv):
    rc = main(["plan", *map(str, argv)])
    return rc, capsys.readouterr().out


def test_dp_is_derived_from_gpus(capsys):
    cfg = load_config(CONFIGS / "llama3_70b.yaml", ["train.global_batch_size=128"])
    planned = plan_memory(cfg, 32, 96)
    assert planned.dp == 2 and planned.param_precision == "bf16"  # the GPUs' precision, on any machine
    rc, out = _plan(
        capsys,
        CONFIGS / "llama3_70b.yaml",
        "--gpus",
        32,
        "--gpu-memory",
        96,
        "--no-search",
        "--set",
        "train.global_batch_size=128",
    )
    assert rc == 0 and "tp4 x pp4 x dp2 = 32 GPUs of 96 GiB" in out


def test_llama70b_acceptance_first_layout_written_back_fits(capsys, tmp_path):
    path = CONFIGS / "llama3_70b.yaml"
    assert plan_memory(load_config(path), 16, 96).fits  # as shipped
    rc, out = _plan(capsys, path, "--gpus", 16, "--gpu-memory", 96)
    assert rc == 0
    first = re.search(r"^  #1 (.*)\((--set .*)\)$", out, re.M)
    assert first and "tp8 x pp2 x dp1" in first.group(1)
    sets = first.group(2).replace("--set ", "").split()
    cfg = load_config(path, sets)
    plan = plan_memory(cfg, 16, 96)
    assert plan.fits and (plan.tp, plan.pp, plan.dp) == (8, 2, 1)
    rc, again = _plan(capsys, path, "--gpus", 16, "--gpu-memory", 96, "--no-search", *(f"--set={s}" for s in sets))
    assert rc == 0 and ": fits" in again and "NOT" not in again


def test_too_small_gpu_memory_says_what_to_change(capsys):
    path = CONFIGS / "llama3_70b.yaml"
    rc, out = _plan(capsys, path, "--gpus", 16, "--gpu-memory", 96, "--set", "parallelism.recompute=selective")
    change = [line for line in out.splitlines() if "as configured" in line]
    assert rc == 0 and len(change) == 1
    assert change[0].startswith("train: does NOT fit as configured; change to tp8 x pp2 x dp1, 64 micro-batches")
    rc, out = _plan(capsys, path, "--gpus", 16, "--gpu-memory", 40)
    assert rc == 0
    assert out.rstrip().splitlines()[-1].startswith("train: no layout of 16 GPUs fits 40 GiB (the smallest peak is ")


def test_help_says_gib(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "GiB" in text and "GB " not in text
