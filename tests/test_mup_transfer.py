"""experiments/tools/mup_transfer.py (issue 36 item 3): the sweep's batches, grid and report as
numbers, and a tiny in-process sweep on the tests' stores (the GPU sweep is the same code)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.runs import config
from trainer.config.tools import ConfigError
from trainer.model.flops import flops_per_token

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mt():
    spec = importlib.util.spec_from_file_location("mup_transfer", ROOT / "experiments/tools/mup_transfer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mup_transfer"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def sweep(mt, **kw):
    return mt.Sweep(
        **{"widths": (32, 64), "lrs": (1e-3, 1e-2), "steps": 3, "batch": 2, "seq": 16, "base_width": 32, **kw}
    )


def test_sequences_are_packed_within_each_domain_and_batches_are_whole_shuffled_passes(mt):
    assert mt.packed_starts([10, 4, 9], 4) == [0, 4, 14, 18]  # (n - 1) // seq windows of seq + 1 tokens each
    order = mt.batch_order(5, steps=3, batch=4, seed=0)
    assert order.shape == (3, 4)
    flat = order.flatten().tolist()
    assert sorted(flat[:5]) == sorted(flat[5:10]) == [0, 1, 2, 3, 4]  # whole passes, then the next begun
    assert torch.equal(order, mt.batch_order(5, steps=3, batch=4, seed=0))
    tokens = torch.arange(20)
    batch = mt.gather(tokens, torch.tensor([0, 8]), 4)
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]


def test_the_base_width_runs_once_and_fills_both_tables(mt):
    s = sweep(mt)
    assert mt.runs_to_make(s) == [
        ("standard", 32, 1e-3),
        ("standard", 32, 1e-2),
        ("standard", 64, 1e-3),
        ("mup", 64, 1e-3),
        ("standard", 64, 1e-2),
        ("mup", 64, 1e-2),
    ]
    assert mt.runs_to_make(sweep(mt, params=("mup",)))[0] == ("mup", 32, 1e-3)
    results = [
        mt.RunResult(p, w, lr, v, {}, [], 0.0, True)
        for (p, w, lr), v in zip(mt.runs_to_make(s), [3, 2, 4, 5, 1, math.inf])
    ]
    g = mt.grid(results, s)
    assert g["mup"] == {(32, 1e-3): 3, (32, 1e-2): 2, (64, 1e-3): 5, (64, 1e-2): math.inf}
    assert mt.best_lrs(g["standard"], s.widths, s.lrs) == {32: 1e-2, 64: 1e-2}
    assert mt.best_lrs(g["mup"], s.widths, s.lrs) == {32: 1e-2, 64: 1e-3}
    lines = mt.table(results, s)
    assert "| 0.01 | **2.0000** | diverged |" in lines
    assert "(log2 shift from width 32: +0.00, -3.32); the same at every width: no" in lines
    assert "(log2 shift from width 32: +0.00, +0.00); the same at every width: yes" in lines


def test_the_time_estimate_is_training_flops_at_30_percent_of_an_h100(mt, tmp_path):
    s = sweep(mt, steps=100, batch=4, seq=16)
    cfg = mt.model_config(config(tmp_path / "stores", tmp_path / "run").model, 64, "mup", s)
    assert (cfg.d_model, cfg.ffn_dim, cfg.mup.base_width, cfg.compile) == (64, 160, 32, False)
    assert mt.estimate_seconds([cfg, cfg], s) == pytest.approx(2 * flops_per_token(cfg, 16) * 6400 / (989e12 * 0.3))


def test_a_tiny_sweep_writes_its_table_json_and_plot(mt, stores, tmp_path):
    cfg = config(stores, tmp_path / "run")
    s = sweep(mt, widths=(32, 64), lrs=(1e-3, 3e-2), steps=4)
    head = {"command": "test", "device": "cpu", "estimate_s": 0.0, "setup": {"config": "tiny"}}
    results = mt.sweep_runs(cfg, s, torch.device("cpu"), tmp_path / "out", head, work=tmp_path / "work")
    assert [(r.param, r.width, r.lr) for r in results] == mt.runs_to_make(s)
    assert all(r.finite and len(r.curve) == 0 and r.val_loss > 0 for r in results)  # curve_every 10 > 4 steps
    assert results[0].shared and not results[2].shared
    # the skipped muP run at the base width is the standard one, to the last bit (r = 1)
    data = mt.load_tokens(cfg, s, torch.device("cpu"))
    order = mt.batch_order(len(data.starts), s.steps, s.batch, s.seed)
    again = mt.train_one(cfg, s, data, order, "mup", 32, 1e-3, torch.device("cpu"))
    assert again.val_per_domain == results[0].val_per_domain
    written = json.loads((tmp_path / "out" / "mup_transfer.json").read_text())
    assert len(written["runs"]) == 6 and written["sweep"]["widths"] == [32, 64]
    md = (tmp_path / "out" / "mup_transfer.md").read_text()
    assert md.startswith("# muP transfer sweep") and md.count("best lr per width: 32: ") == 2
    assert (tmp_path / "out" / "mup_transfer.png").stat().st_size > 0
    # the same sweep again runs nothing (max_seconds=0 would stop any run); another sweep reuses nothing
    again_head = {**head}
    assert mt.sweep_runs(cfg, s, torch.device("cpu"), None, again_head, 0, tmp_path / "work") == results
    assert again_head["reused"] == 6
    assert mt.sweep_runs(cfg, replace(s, steps=5), torch.device("cpu"), None, {**head}, 0, tmp_path / "work") == []


def test_a_width_the_heads_do_not_divide_or_an_unknown_domain_is_one_line(mt, stores, tmp_path):
    with pytest.raises(mt.SweepError, match=r"multiple of model.n_heads=4, got \[30\]"):
        mt.sweep_runs(config(stores, tmp_path / "run"), sweep(mt, widths=(30,)), torch.device("cpu"), None, {})
    with pytest.raises(mt.SweepError, match=r"--domains \['code'\] not in the stores' \['noise', 'easy', 'markov'\]"):
        mt.sweep_runs(config(stores, tmp_path / "run"), sweep(mt, domains=("code",)), torch.device("cpu"), None, {})


def test_the_fitted_optimum_is_the_vertex_of_the_log2_parabola_through_the_best_and_its_neighbours(mt):
    assert mt.fitted_optimum({1e-3: 2.0, 2e-3: 1.0, 4e-3: 2.0}) == pytest.approx(2e-3)  # symmetric: the best itself
    # log2 points 0, 1, 2 (x 1e-3) with losses 3, 1, 2: vertex at 7/6
    assert mt.fitted_optimum({1e-3: 3.0, 2e-3: 1.0, 4e-3: 2.0, 8e-3: 5.0}) == pytest.approx(1e-3 * 2 ** (7 / 6))
    assert mt.fitted_optimum({1e-3: 1.0, 2e-3: 2.0, 4e-3: 3.0}) is None  # best at the edge: not bracketed
    assert mt.fitted_optimum({1e-3: math.inf, 2e-3: 1.0, 4e-3: 3.0}) is None  # a diverged neighbour
    assert mt.fitted_line({32: 2e-3, 64: 1e-3, 128: None}) == (
        "fitted optimum (parabola in log2 lr through the best and its neighbours) per width: "
        "32: 0.002, 64: 0.001, 128: not bracketed (octaves from width 32: +0.00, -1.00, -)"
    )


def test_the_session_6_gpu_mup_table_fits_a_quarter_octave_shift_at_width_1024(mt):
    """The muP half of the first GPU sweep (H100, 500 steps; issue 36): the grid's best moved one
    point at width 1024 (0.002 -> 0.001), the fitted optimum 0.24 octave: the base width's
    optimum (0.00153) lay 0.12 octave above the middle of 0.001 and 0.002."""
    s = sweep(mt, widths=(256, 512, 1024), lrs=(0.0005, 0.001, 0.002, 0.004), base_width=256, params=("mup",))
    losses = {
        256: (4.4351, 4.0209, 3.9774, 4.3112),
        512: (4.3631, 3.9512, 3.8886, 4.2514),
        1024: (4.3252, 3.8520, 3.9180, 4.3016),
    }
    results = [mt.RunResult("mup", w, lr, v, {}, [], 0.0, True) for w in s.widths for lr, v in zip(s.lrs, losses[w])]
    assert (
        "fitted optimum (parabola in log2 lr through the best and its neighbours) per width: "
        "256: 0.00153, 512: 0.00157, 1024: 0.0013 (octaves from width 256: +0.00, +0.03, -0.24)"
    ) in mt.table(results, s)


def test_mup_emb_scales_only_the_embedding_lr_and_shares_the_base_width_runs(mt, stores, tmp_path, monkeypatch):
    s = sweep(mt, widths=(32, 128), lrs=(1e-3,), params=("mup", "mup-emb"))
    assert mt.runs_to_make(s) == [("mup", 32, 1e-3), ("mup", 128, 1e-3), ("mup-emb", 128, 1e-3)]
    assert mt.embedding_lr_multiplier("mup-emb", 128, s) == 0.5  # r = 4
    assert mt.embedding_lr_multiplier("mup", 128, s) == mt.embedding_lr_multiplier("mup-emb", 32, s) == 1.0
    results = [mt.RunResult(p, w, lr, v, {}, [], 0.0, True) for (p, w, lr), v in zip(mt.runs_to_make(s), [3, 2, 1])]
    assert mt.grid(results, s) == {"mup": {(32, 1e-3): 3, (128, 1e-3): 2}, "mup-emb": {(32, 1e-3): 3, (128, 1e-3): 1}}
    cfg = config(stores, tmp_path / "run")
    assert mt.model_config(cfg.model, 128, "mup-emb", s).mup.base_width == 32
    with pytest.raises(mt.SweepError, match=r"--params mup-emb scales the embedding's lr, which tied embeddings share"):
        mt.model_config(replace(cfg.model, tie_embeddings=True), 128, "mup-emb", s)
    import trainer.optim.build as build

    seen: dict[str, float] = {}
    real = build.build_optimizer

    def spy(named, *args, **kw):
        seen.update({n: getattr(p, "_lr_scale", 1.0) for n, p in named})
        return real(named, *args, **kw)

    monkeypatch.setattr(build, "build_optimizer", spy)
    one = replace(s, steps=1)
    data = mt.load_tokens(cfg, one, torch.device("cpu"))
    order = mt.batch_order(len(data.starts), 1, one.batch, one.seed)
    assert mt.train_one(cfg, one, data, order, "mup-emb", 128, 1e-3, torch.device("cpu")).finite
    assert (seen["embed.weight"], seen["head.weight"], seen["layers.0.attn.qkv.weight"]) == (0.5, 1.0, 0.25)


def test_zero_init_is_for_the_mup_arms_whose_base_width_runs_are_their_own(mt, stores, tmp_path):
    """`--zero-init`: the muP arms start with a zero head and queries, the standard arm as
    before; at the base width the two are then different models, each run there."""
    s = sweep(mt, params=("standard", "mup", "mup-emb"), zero_init=True)
    assert mt.runs_to_make(s)[:4] == [
        ("standard", 32, 1e-3),
        ("mup", 32, 1e-3),
        ("standard", 32, 1e-2),
        ("mup", 32, 1e-2),
    ]
    assert len(mt.runs_to_make(s)) == 4 + 6
    results = [mt.RunResult(p, w, lr, float(i), {}, [], 0.0, True) for i, (p, w, lr) in enumerate(mt.runs_to_make(s))]
    g = mt.grid(results, s)
    assert g["standard"][(32, 1e-3)] == 0 and g["mup"][(32, 1e-3)] == g["mup-emb"][(32, 1e-3)] == 1
    cfg = config(stores, tmp_path / "run")
    assert mt.model_config(cfg.model, 64, "mup", s).mup.zero_init
    assert mt.model_config(cfg.model, 64, "standard", s).mup is None
    assert not mt.model_config(cfg.model, 64, "mup", sweep(mt)).mup.zero_init
    with pytest.raises(ConfigError, match=r"^model.mup.zero_init: a tied head is the embedding"):
        mt.model_config(replace(cfg.model, tie_embeddings=True), 64, "mup", s)
    # runs kept under --work without zero init are not reused with it, and the other way round
    one = sweep(mt, widths=(32,), lrs=(1e-3,), steps=1, params=("mup",))
    head = {"command": "test", "device": "cpu", "estimate_s": 0.0, "setup": {"config": "tiny"}}
    work = tmp_path / "work"
    first = mt.sweep_runs(cfg, one, torch.device("cpu"), None, {**head}, work=work)
    zero = {**head}
    assert mt.sweep_runs(cfg, replace(one, zero_init=True), torch.device("cpu"), None, zero, 0, work) == []
    assert zero["reused"] == 0 and json.loads((work / "mup_transfer.json").read_text())["sweep"]["zero_init"] is False
    assert mt.sweep_runs(cfg, one, torch.device("cpu"), None, {**head}, 0, work) == first


def test_the_code_hash_covers_every_python_file_s_bytes(mt, tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.md").write_text("not code\n")
    (tmp_path / "tool.py").write_text("y = 2\n")
    before = mt.code_hash(tmp_path, ("pkg", "tool.py"))
    (tmp_path / "pkg" / "notes.md").write_text("edited\n")
    assert mt.code_hash(tmp_path, ("pkg", "tool.py")) == before
    (tmp_path / "pkg" / "sub" / "a.py").write_text("x = 2\n")
    assert mt.code_hash(tmp_path, ("pkg", "tool.py")) != before
    assert mt.CODE == ("trainer", "data", "experiments/tools/mup_transfer.py")
    assert mt.code_hash() == mt.code_hash()


def test_runs_kept_by_other_code_are_run_again(mt, stores, tmp_path, monkeypatch):
    """A run kept under `--work` is reused only under the same `code_hash`: after a change to the
    trainer (muP's weight-decay rule, say) it would be stale."""
    cfg = config(stores, tmp_path / "run")
    s = sweep(mt, widths=(32,), lrs=(1e-3,), steps=1)
    head = {"command": "test", "device": "cpu", "estimate_s": 0.0, "setup": {"config": "tiny"}}
    work = tmp_path / "work"
    first = mt.sweep_runs(cfg, s, torch.device("cpu"), None, {**head}, work=work)
    assert json.loads((work / "mup_transfer.json").read_text())["code"] == mt.code_hash()
    same = {**head}
    assert mt.sweep_runs(cfg, s, torch.device("cpu"), None, same, 0, work) == first and same["reused"] == 1
    monkeypatch.setattr(mt, "code_hash", lambda: "changed")
    changed = {**head}
    assert mt.sweep_runs(cfg, s, torch.device("cpu"), None, changed, 0, work) == [] and changed["reused"] == 0
    again = mt.sweep_runs(cfg, s, torch.device("cpu"), None, changed, work=work)
    assert [(r.param, r.width, r.lr) for r in again] == [("standard", 32, 1e-3)] and changed["reused"] == 0
    assert json.loads((work / "mup_transfer.json").read_text())["code"] == "changed"
