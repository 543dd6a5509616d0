"""doremi/reports/ledger.py's study part: evaluation tokens from each source, sums that say when a
part is unknown, an arm's stages."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from doremi.reports.ledger import arm_ledger, evaluation_tokens, holdout_tokens, study_run_cost, sum_costs


def _cfg(eval_sequences: int, split: str = "none", store: str | None = None) -> dict:
    data = {"seq_len": 16, "domains": [{"name": "a"}, {"name": "b"}, {"name": "c"}], "validation_split": split}
    if store:
        data["store_dir"] = store
    return {"train": {"eval_sequences": eval_sequences}, "data": data}


def test_evaluation_tokens_from_each_source(tmp_path):
    assert evaluation_tokens(_cfg(8), 5) == 5 * 8 * 3 * 16
    assert evaluation_tokens(_cfg(8), 0) == 0.0
    assert evaluation_tokens(_cfg(0), 5) is None  # the whole split, nothing says how large
    run = tmp_path / "run"
    (run / "eval_sequences").mkdir(parents=True)
    np.savez(run / "eval_sequences" / "step_0000010.npz", tokens=np.full(7, 15, dtype=np.int32))
    assert evaluation_tokens(_cfg(0, "dev_test"), 5, run) == 5 * 7 * 16
    assert evaluation_tokens(_cfg(0, "dev_test", str(tmp_path / "stores")), 5) is None
    # what the passes logged comes first; a pass that did not log it leaves the other sources
    assert evaluation_tokens(_cfg(0, "dev_test"), 2, None, [320, 480]) == 800.0
    assert evaluation_tokens(_cfg(8), 2, None, [320, None]) == 2 * 8 * 3 * 16


def test_holdout_tokens_only_with_a_memorisation_row():
    cfg = _cfg(8)
    cfg["data"]["holdout_sequences"] = 4
    assert holdout_tokens(cfg, [{"step": 1, "val_loss": {}}]) == 0.0
    assert holdout_tokens(cfg, [{"step": 1, "seen_loss": {"a": 1.0}}]) == 2 * 4 * 3 * 16


def test_sum_costs_is_none_where_a_part_is_unknown():
    a = {"train": 1.0, "reference": 0.0, "target": 0.0, "validation": 0.0, "evaluation": 2.0, "total": 3.0}
    b = {**a, "evaluation": None, "total": None, "gpu_seconds": 4.0}
    got = sum_costs([a, b])
    assert got["train"] == 2.0 and got["evaluation"] is None and got["total"] is None and got["gpu_seconds"] is None
    assert sum_costs([b])["gpu_seconds"] == 4.0


def test_arm_ledger_names_a_stage_without_config(tmp_path):
    run = tmp_path / "uniform-seed1"
    run.mkdir()
    model = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 16}
    cfg = {"model": model, "train": {"steps": 10, "global_batch_size": 4, "eval_sequences": 2}, "data": _cfg(2)["data"]}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": 10, "loss": 1.0, "tokens_per_s": 320.0}, {"step": 10, "val_loss": {"a": 1.0, "b": 1.0, "c": 1.0}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cost = study_run_cost(run, "main")
    assert cost["gpu_seconds"] == pytest.approx(10 * 4 * 16 / 320.0)
    assert cost["evaluation"] == pytest.approx(cost["train"] / 3 * (2 * 3 * 16) / (10 * 4 * 16))
    assert cost["total"] == pytest.approx(cost["train"] + cost["evaluation"])
    got = arm_ledger([("reference", tmp_path / "reference-seed1"), ("main", run)])
    assert got["missing"] == [f"reference: {tmp_path / 'reference-seed1'}"] and got["sum"]["train"] == cost["train"]
