"""Sharded atomic checkpoints: resharding across (tp, pp, dp), resume, and bad checkpoints.

A checkpoint is written at (tp2, pp2, dp2) with ZeRO-1 by the toy stage of test_zero_optim (tied
embeddings: the last stage holds a duplicate of `embed.weight`) after two AdamW steps with
clipping; every rank also dumps its live tensors. Each target layout loads it into freshly
initialised stages and compares every parameter and optimizer state tensor with the dumped
originals reassembled to full tensors (`unshard`) and cut for the new tp rank (`shard`): exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.test_zero_optim import (
    CPU,
    MAX_NORM,
    build_stage,
    dp_step,
    full_grads,
    full_tensors,
    stage_names,
    toy_specs,
    train_cfg,
)
from trainer.checkpoint.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.optim.build import build_optimizer
from trainer.optim.clip import clip_grad_norm
from trainer.parallel.context import ParallelContext
from trainer.parallel.shard import shard, unshard

SAVE_LAYOUT = (2, 2, 2)
SAVE_LRS = (1e-2, 2e-2)


def reference_full_step() -> dict[str, torch.Tensor]:
    """The single-process run of the save job: full tensors, summed dp gradients, torch's clip."""
    specs = toy_specs(tied=True)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    params = dict(model.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for step, lr in enumerate(SAVE_LRS):
        for name, g in full_grads(specs).items():
            params[name].grad = g * (step + 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _save_worker(rank: int, world: int, run_dir: str) -> None:
    tp, pp, dp = SAVE_LAYOUT
    pc = ParallelContext.from_process_group(tp, pp, dp, CPU)
    specs = toy_specs(tied=True)
    model = build_stage(full_tensors(specs, 0), specs, stage_names(specs, pp, pc.pp_rank, True), tp, pc.tp_rank)
    named = list(model.named_parameters())
    opt = build_optimizer(named, train_cfg("adamw"), pc, zero1=True)
    grads = full_grads(specs)
    total = torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()
    for step, lr in enumerate(SAVE_LRS):
        # Each dp rank holds part of the gradient (1/4 and 3/4: exact in binary); the sum is the full one.
        part = 0.25 if pc.dp_rank == 0 else 0.75
        for name, p in named:
            p.grad = shard(grads[name] * (step + 1) * part, specs[name][1], pc.tp_rank, tp).clone()
        opt.reduce_gradients()
        norm = clip_grad_norm(named, MAX_NORM, pc)
        assert float(norm) == pytest.approx(total * (step + 1), rel=1e-6)
        opt.step(lr)
        opt.zero_grad()
    ref = reference_full_step()
    for name, p in named:
        torch.testing.assert_close(
            p.detach(), shard(ref[name], specs[name][1], pc.tp_rank, tp), rtol=0, atol=1e-6, msg=name
        )
    save_checkpoint(run_dir, 2, model, opt, pc, {"step": 2, "data": {"cursor": [3, 4]}, "alpha": torch.ones(3)}, keep=2)
    dump = {
        "pp": pc.pp_rank,
        "tp": pc.tp_rank,
        "dp": pc.dp_rank,
        "params": {n: p.detach().clone() for n, p in named},
        "state": {n: {k: v.clone() for k, v in s.items()} for n, s in opt.state_dict()["state"].items()},
    }
    torch.save(dump, Path(run_dir) / f"dump_rank{rank}.pt")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    spawn(_save_worker, SAVE_LAYOUT[0] * SAVE_LAYOUT[1] * SAVE_LAYOUT[2], str(run_dir))
    return run_dir


def originals(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Full parameters and optimizer state reassembled from every saving rank's live tensors."""
    specs = toy_specs(tied=True)
    params: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for f in sorted(run_dir.glob("dump_rank*.pt")):
        d = torch.load(f, weights_only=True)
        for n, t in d["params"].items():
            assert torch.equal(params.setdefault(n, {}).setdefault(d["tp"], t), t), n
        for n, s in d["state"].items():
            assert d["tp"] not in state.get(n, {}) or n == "embed.weight", n
            state.setdefault(n, {})[d["tp"]] = s
    full_p = {n: unshard([params[n][t] for t in range(SAVE_LAYOUT[0])], specs[n][1]) for n in specs}
    full_s = {
        n: {
            k: (
                state[n][0][k] if k == "step" else unshard([state[n][t][k] for t in range(SAVE_LAYOUT[0])], specs[n][1])
            )
            for k in state[n][0]
        }
        for n in specs
    }
    return full_p, full_s


def check_loaded(pc: ParallelContext, run_dir: Path, zero1: bool, with_optimizer: bool = True) -> None:
    specs = toy_specs(tied=True)
    model = build_stage(full_tensors(specs, 5), specs, stage_names(specs, pc.pp, pc.pp_rank, True), pc.tp, pc.tp_rank)
    named = list(model.named_parameters())
    opt = build_optimizer(named, train_cfg("adamw"), pc, zero1) if with_optimizer else None
    extra = load_checkpoint(run_dir, model, opt, pc)
    assert extra["step"] == 2 and extra["data"] == {"cursor": [3, 4]} and torch.equal(extra["alpha"], torch.ones(3))
    full_p, full_s = originals(run_dir)
    for name, p in named:
        assert torch.equal(p.detach(), shard(full_p[name], specs[name][1], pc.tp_rank, pc.tp)), name
    if opt is None:
        return
    state = opt.state_dict()["state"]
    assert sorted(state) == sorted(opt.owned_names()) and state
    for name, s in state.items():
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(s["step"]) == 2.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[k], shard(full_s[name][k], specs[name][1], pc.tp_rank, pc.tp)), (name, k)


#: Target layouts of two processes, checked in one spawn (process start-up dominates the runtime).
LOAD_LAYOUTS = [(1, 1, 2, True), (1, 1, 2, False), (2, 1, 1, False), (1, 2, 1, False)]


def _load_worker(rank: int, world: int, run_dir: str) -> None:
    for tp, pp, dp, zero1 in LOAD_LAYOUTS:
        try:
            check_loaded(ParallelContext.from_process_group(tp, pp, dp, CPU), Path(run_dir), zero1)
        except AssertionError as e:
            raise AssertionError(f"layout tp={tp} pp={pp} dp={dp} zero1={zero1}: {e}") from e


def test_saved_layout_and_metadata(saved_run):
    ck = latest_checkpoint(saved_run)
    assert ck == saved_run / "checkpoints" / "step_0000002"
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["layout"] == {"tp": 2, "pp": 2, "dp": 2} and meta["step"] == 2 and meta["zero1"]
    assert meta["params"]["embed.weight"] == {
        "shape": [32, 16],
        "spec": {"dim": 0, "parts": [32]},
        "dtype": "float32",
        "stage": 0,
        "files": ["model_pp0_tp0.pt", "model_pp0_tp1.pt"],
    }
    assert meta["params"]["layers.3.norm.weight"]["spec"] is None
    assert sorted(meta["params"]) == sorted(toy_specs(tied=True))
    model_files = sorted(f.name for f in ck.glob("model_*.pt"))
    assert model_files == ["model_pp0_tp0.pt", "model_pp0_tp1.pt", "model_pp1_tp0.pt", "model_pp1_tp1.pt"]
    assert len(list(ck.glob("optim_*.pt"))) == 8 and len(list(ck.glob("rng_rank*.pt"))) == 8
    assert not list(saved_run.glob("checkpoints/*.tmp"))


@pytest.mark.dist
def test_reshard_on_load_into_dp2_tp2_pp2(saved_run):
    spawn(_load_worker, 2, str(saved_run))


def test_reshard_into_one_process_with_and_without_optimizer(saved_run):
    check_loaded(ParallelContext.single(), saved_run, zero1=False)
    check_loaded(ParallelContext.single(), saved_run, zero1=False, with_optimizer=False)


# -- single process: resume, retention, bad checkpoints -------------------------------------------


def toy_run(seed: int = 0, kind: str = "adamw"):
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, seed), specs, list(specs), 1, 0)
    return model, build_optimizer(list(model.named_parameters()), train_cfg(kind), ParallelContext.single(), True)


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_resume_reproduces_next_step_and_rng(tmp_path, kind):
    pc = ParallelContext.single()
    model, opt = toy_run(0, kind)
    for step in range(2):
        dp_step(model, opt, pc, step)
    torch.manual_seed(11)
    save_checkpoint(tmp_path, 2, model, opt, pc, {"step": 2}, keep=1)
    after_save = torch.rand(4)
    dp_step(model, opt, pc, 2)
    fresh, opt2 = toy_run(1, kind)
    assert load_checkpoint(tmp_path, fresh, opt2, pc) == {"step": 2}
    assert torch.equal(torch.rand(4), after_save)
    dp_step(fresh, opt2, pc, 2)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_keep_last_and_partial_tmp_ignored_then_cleaned(tmp_path):
    pc = ParallelContext.single()
    model, opt = toy_run()
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, None, pc, {"step": step}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(d.name for d in root.iterdir()) == ["step_0000002", "step_0000003"]
    crashed = root / "step_0000004.tmp"
    crashed.mkdir()
    (crashed / "model_pp0_tp0.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == root / "step_0000003"
    save_checkpoint(tmp_path, 5, model, opt, pc, {"step": 5}, keep=0)
    assert sorted(d.name for d in root.iterdir()) == ["step_0000002", "step_0000003", "step_0000005"]


def test_bad_checkpoints_give_one_line_errors(tmp_path):
    pc = ParallelContext.single()
    model, opt = toy_run()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        load_checkpoint(tmp_path / "nothing", model, None, pc)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model, None, pc)
    with pytest.raises(TypeError, match=r"extra.data\[0\]: .* got set"):
        save_checkpoint(tmp_path, 1, model, None, pc, {"data": [{1, 2}]})
    ck = save_checkpoint(tmp_path, 1, model, None, pc, {"step": 1})

    with pytest.raises(CheckpointError, match="checkpoint has no optimizer state"):
        load_checkpoint(ck, model, opt, pc)
    specs = {**toy_specs(tied=False), "layers.1.up.weight": ((48, 16), None)}
    wide = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    with pytest.raises(
        CheckpointError,
        match=r"'layers.1.up.weight' has shape \(32, 16\) in the checkpoint, "
        r"the model expects \(48, 16\)",
    ):
        load_checkpoint(ck, wide, None, pc)

    target = ck / "model_pp0_tp0.pt"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError,
        match=r"model_pp0_tp0.pt: truncated or corrupted checkpoint file \(expected \d+ bytes, found \d+\)",
    ):
        load_checkpoint(ck, model, None, pc)
    target.write_bytes(b"\0" * len(data))
    with pytest.raises(CheckpointError, match="model_pp0_tp0.pt: corrupted checkpoint file"):
        load_checkpoint(ck, model, None, pc)
    os.remove(target)
    with pytest.raises(CheckpointError, match="model_pp0_tp0.pt: checkpoint file missing"):
        load_checkpoint(ck, model, None, pc)
    (ck / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json: unreadable checkpoint metadata"):
        load_checkpoint(ck, model, None, pc)
