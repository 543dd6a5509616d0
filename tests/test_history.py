"""domain_weights.jsonl: writing, reading, resume truncation, averaging, the weights file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from doremi.methods.history import (
    HISTORY_FILE,
    HistoryError,
    WeightHistory,
    average_weights,
    read_history,
    read_weights_json,
    write_weights_json,
)

DOMAINS = ["web", "code", "books"]
WEIGHTS = {1: [0.5, 0.25, 0.25], 2: [0.2, 0.3, 0.5], 3: [0.3, 0.3, 0.4], 4: [0.6, 0.2, 0.2]}


def _record(step, **kw):
    return {
        "step": step,
        "domains": DOMAINS,
        "weights": [1.0, 0.0, 0.0],
        "excess": [0, 0, 0],
        "proxy_loss": [0, 0, 0],
        "ref_loss": [0, 0, 0],
        "tokens": [1, 1, 1],
        **kw,
    }


def _log(run_dir, steps, resume_step=0):
    with WeightHistory(run_dir, resume_step=resume_step) as h:
        for s in steps:
            h.append(
                {
                    "step": s,
                    "domains": DOMAINS,
                    "weights": torch.tensor(WEIGHTS[s], dtype=torch.float64),
                    "excess": [0.1 * s, 0.0, 1.0],
                    "proxy_loss": np.array([3.0, 2.0, 1.0]) + s,
                    "ref_loss": [2.5, 1.5, 0.5],
                    "tokens": torch.tensor([10, 20, 30]),
                }
            )


def test_records_round_trip_and_each_line_is_flushed(tmp_path):
    h = WeightHistory(tmp_path, domains=DOMAINS)
    same = dict(excess=[0.0, 1.0, 2.0], proxy_loss=[3.0, 2.0, 1.0], ref_loss=[2.5, 1.5, 0.5], update="exact")
    h.append({"step": 1, "weights": torch.tensor([0.5, 0.25, 0.25]), "tokens": [10.0, 20.0, 30.0], **same})
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()  # before close: flushed
    assert json.loads(lines[0]) == _record(1, weights=[0.5, 0.25, 0.25], tokens=[10, 20, 30], **same)
    h.close()
    assert read_history(tmp_path)[0]["tokens"] == [10, 20, 30]
    assert read_history(tmp_path / HISTORY_FILE)[0]["step"] == 1


def test_resume_drops_later_steps_and_matches_uninterrupted_run(tmp_path):
    _log(tmp_path / "a", [1, 2, 3, 4])
    _log(tmp_path / "b", [1, 2, 3])  # crashed after step 3, checkpoint at step 2
    _log(tmp_path / "b", [3, 4], resume_step=2)
    assert (tmp_path / "a" / HISTORY_FILE).read_text() == (tmp_path / "b" / HISTORY_FILE).read_text()
    assert [r["step"] for r in read_history(tmp_path / "b")] == [1, 2, 3, 4]


def test_fresh_run_overwrites_old_history(tmp_path):
    _log(tmp_path, [1, 2, 3])
    _log(tmp_path, [1])
    assert [r["step"] for r in read_history(tmp_path)] == [1]


def test_torn_last_line_is_ignored_and_dropped_on_resume(tmp_path):
    _log(tmp_path, [1, 2])
    path = tmp_path / HISTORY_FILE
    with open(path, "a") as f:
        f.write('{"step": 3, "domains": ["web", "co')
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2]
    _log(tmp_path, [3], resume_step=2)
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2, 3]


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / HISTORY_FILE
    path.write_text('{"step": 1, "weights": [1.0]}\nnot json\n{"step": 3, "weights": [1.0]}\n')
    with pytest.raises(HistoryError, match=rf"{HISTORY_FILE}:2: expected a JSON object"):
        read_history(tmp_path)


def test_append_rejects_bad_records(tmp_path):
    with WeightHistory(tmp_path) as h:
        h.append(_record(1))
        with pytest.raises(HistoryError, match="step 1 is not an integer after the last logged step 1"):
            h.append(_record(1))
        with pytest.raises(HistoryError, match="excess: expected 3 values .* got 2"):
            h.append(_record(2, excess=[0, 0]))
        with pytest.raises(HistoryError, match="step 2: missing per-domain field 'tokens'"):
            h.append({k: v for k, v in _record(2).items() if k != "tokens"})
        with pytest.raises(
            HistoryError,
            match=r"step 2 has domains \['a', 'b', 'c'\], "
            r"expected \['web', 'code', 'books'\]",
        ):
            h.append(_record(2, domains=["a", "b", "c"]))


def test_resume_with_other_domains_is_an_error(tmp_path):
    _log(tmp_path, [1, 2])
    with pytest.raises(
        HistoryError,
        match=r"step 1 has domains \['web', 'code', 'books'\], "
        r"expected \['web', 'code'\]",
    ):
        WeightHistory(tmp_path, resume_step=2, domains=["web", "code"])


def test_missing_history_is_an_error(tmp_path):
    with pytest.raises(HistoryError, match="weight history not found"):
        read_history(tmp_path)


def test_average_weights(tmp_path):
    _log(tmp_path, [1, 2, 3, 4])
    hist = read_history(tmp_path)
    # mean of steps 1..4: [1.6, 1.05, 1.35] / 4
    np.testing.assert_allclose(average_weights(hist), [0.4, 0.2625, 0.3375], rtol=0, atol=1e-15)
    # steps 3..4: [0.9, 0.5, 0.6] / 2
    np.testing.assert_allclose(average_weights(hist, from_step=3), [0.45, 0.25, 0.3], rtol=0, atol=1e-15)
    with pytest.raises(HistoryError, match="no step >= 5 in the history"):
        average_weights(hist, from_step=5)


def test_weights_json_round_trip_with_provenance(tmp_path):
    path = tmp_path / "out" / "weights.json"
    write_weights_json(
        path,
        DOMAINS,
        np.array([0.4, 0.2625, 0.3375]),
        {"source": "runs/proxy", "steps": [1, 4], "eta": 1.0, "smoothing": 1e-3},
    )
    doc = read_weights_json(path)
    assert doc["domains"] == DOMAINS and doc["weights"] == [0.4, 0.2625, 0.3375]
    assert doc["source"] == "runs/proxy" and doc["steps"] == [1, 4] and doc["smoothing"] == 1e-3
    assert doc["created"].endswith("+00:00")
    assert [p.name for p in path.parent.iterdir()] == ["weights.json"]  # no temp file left


def test_weights_json_rejects_non_distributions_and_writes_nothing(tmp_path):
    path = tmp_path / "weights.json"
    with pytest.raises(HistoryError, match="summing to 1"):
        write_weights_json(path, DOMAINS, [0.5, 0.5, 0.5], {})
    with pytest.raises(HistoryError, match="weights: expected 3 values"):
        write_weights_json(path, DOMAINS, [0.5, 0.5], {})
    with pytest.raises(HistoryError, match=r"provenance must not set \['weights'\]"):
        write_weights_json(path, DOMAINS, [0.5, 0.25, 0.25], {"weights": 1})
    assert list(tmp_path.iterdir()) == []
    path.write_text('{"domains": ["a", "b"], "weights": [0.7, 0.7]}')
    with pytest.raises(HistoryError, match="summing to 1"):
        read_weights_json(path)
