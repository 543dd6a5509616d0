"""`doremi compare`: paired statistics on hand-computed numbers, roots read from disk, the files
written, and bad input (one line, exit status 2, nothing written)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data.artifact import ArtifactError
from doremi.errors import DoReMiError
from doremi.study.compare import (
    COMPARE_MD,
    COMPARE_PNG,
    MainRun,
    compare,
    compare_roots,
    format_compare,
    mean_se,
    pair,
    read_root,
)

D = ["a", "b", "c"]
# seed 1: mean 2 vs 6.25 / 3, worst 3 vs 3.5, better on a and c; the mixture's mean curve reaches
# the baseline's final 6.25 / 3 at step 20 of 30. Seed 2: mean 2 vs 2, worst 2 vs 2.5, better on
# a and b; never reaches the baseline's final 2.0.
MIX = [
    MainRun(D, [3.0, 2.0, 1.0], [(10, 3.0), (20, 2.0), (30, 1.9)]),
    MainRun(D, [2.0, 2.0, 2.0], [(10, 3.0), (20, 2.9)]),
]
BASE = [
    MainRun(D, [3.5, 1.5, 1.25], [(10, 3.1), (20, 2.5), (30, 6.25 / 3)]),
    MainRun(D, [2.5, 2.5, 1.0], [(10, 2.5), (20, 2.0)]),
]


def test_mean_se():
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert se == pytest.approx(math.sqrt((5 / 3) / 4), abs=1e-15)  # sample variance 5/3, n = 4
    assert mean_se([0.5]) == (0.5, None)
    with pytest.raises(ValueError, match="expected at least one value"):
        mean_se([])


def test_pair_per_seed_and_over_seeds():
    p = pair("doremi", "uniform", ["s1", "s2"], MIX, BASE)
    assert p.mean_diff == pytest.approx([2.0 - 6.25 / 3, 0.0], abs=1e-15)
    assert p.worst_diff == [-0.5, -0.5]
    assert p.improved == [2, 2]
    # per-domain differences averaged over seeds: a (-0.5 - 0.5) / 2, b (0.5 - 0.5) / 2, c (-0.25 + 1) / 2
    assert p.improved_in_mean == 1
    assert p.speedups == [1.5, None]
    mean, se = p.mean
    assert mean == pytest.approx(-1 / 24, abs=1e-15)
    assert se == pytest.approx(1 / 24, abs=1e-15)  # |d1 - d2| / sqrt(2) / sqrt(2)
    assert p.worst == (-0.5, 0.0)


def test_mixture_in_some_roots_is_compared_over_those():
    roots = {
        "s1": {"uniform": BASE[0], "doremi": MIX[0], "tokens": MIX[1]},
        "s2": {"uniform": BASE[1], "doremi": MIX[1]},
        "s3": {"doremi": MIX[0]},
    }
    results, notes = compare(roots, "uniform")
    assert [(p.mixture, p.roots) for p in results] == [("doremi", ["s1", "s2"]), ("tokens", ["s1"])]
    assert notes == [
        "s3: no main/uniform; left out of every comparison",
        "tokens: compared over 1 of 2 roots (missing in s2)",
    ]
    text = format_compare(results, notes, "uniform")
    assert "| doremi | 2 | -0.0417 ± 0.0417 | -0.5000 ± 0.0000 | 2/3, 2/3 | 1/3 | 1.50x, not reached |" in text
    assert "| tokens | 1 | -0.0833 | -1.5000 | 1/3 | 1/3 | not reached | - | - |" in text
    # 2 seeds, differences -1/12 and 0: mean -1/24, SE 1/24, t = -1 on 1 df (two-sided p 0.5), and
    # the interval -1/24 -+ t_{0.975,1} / 24 with t_{0.975,1} = 12.7062 (not -+ 2 SE).
    assert "| 1.50x, not reached | [-0.5711, +0.4878] | t -1.00, p 0.500 |" in text
    assert "| doremi | s2 | +0.0000 | -0.5000 | 2/3 | not reached |" in text
    assert "- tokens: compared over 1 of 2 roots (missing in s2)" in text


def test_compare_rejects_missing_baseline_and_other_domains():
    with pytest.raises(
        DoReMiError, match=r"^--baseline tokens: no root has main/tokens \(mixtures found: doremi, uniform\)$"
    ):
        compare({"s1": {"uniform": BASE[0], "doremi": MIX[0]}}, "tokens")
    with pytest.raises(DoReMiError, match=r"^s2/main/doremi: domains \['a', 'b'\] differ"):
        compare(
            {"s1": {"uniform": BASE[0]}, "s2": {"uniform": BASE[1], "doremi": MainRun(["a", "b"], [1.0, 2.0])}},
            "uniform",
        )


def _root(path: Path, runs: dict[str, MainRun], marker: bool = True) -> Path:
    for name, run in runs.items():
        d = path / "main" / name
        d.mkdir(parents=True)
        rows = [{"step": s, "loss": 1.0} for s, _ in run.curve]
        rows += [{"step": s, "val_loss": {dom: m for dom in run.domains}} for s, m in run.curve]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if marker:
            (d / "eval.json.stage.json").write_text(
                json.dumps(
                    {"stage": "eval", "fingerprint": "x", "result": {"domains": run.domains, "val_loss": run.final}}
                )
            )
    return path


def test_read_root_uses_the_eval_result_else_the_last_validation_row(tmp_path):
    runs = read_root(_root(tmp_path / "s1", {"uniform": BASE[0], "doremi": MIX[0]}))
    assert runs["uniform"].final == [3.5, 1.5, 1.25]
    assert [s for s, _ in runs["doremi"].curve] == [10, 20, 30]
    assert [m for _, m in runs["doremi"].curve] == pytest.approx([3.0, 2.0, 1.9], abs=1e-12)
    bare = read_root(_root(tmp_path / "s2", {"uniform": BASE[1]}, marker=False))
    assert bare["uniform"].final == [2.0, 2.0, 2.0] and bare["uniform"].domains == D


def test_compare_roots_writes_markdown_and_plot(tmp_path):
    r1 = _root(tmp_path / "seed1", {"uniform": BASE[0], "doremi": MIX[0]})
    r2 = _root(tmp_path / "seed2", {"uniform": BASE[1], "doremi": MIX[1]})
    text = compare_roots([r1, r2], tmp_path / "out")
    assert text.startswith("# Mixtures against uniform, paired by seed")
    assert "| doremi | seed2 | +0.0000 | -0.5000 | 2/3 | not reached |" in text
    assert (tmp_path / "out" / COMPARE_MD).read_text().startswith("<!-- written by doremi compare -->\n" + text)
    assert (tmp_path / "out" / COMPARE_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second run replaces its own files; a researcher's compare.md of their own is kept.
    assert compare_roots([r1, r2], tmp_path / "out") == text
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / COMPARE_MD).write_text("# my notes\n")
    with pytest.raises(ArtifactError, match=r"compare.md: exists and was not written by doremi; `doremi compare`"):
        compare_roots([r1, r2], tmp_path / "mine")
    assert (tmp_path / "mine" / COMPARE_MD).read_text() == "# my notes\n"
    assert not (tmp_path / "mine" / COMPARE_PNG).exists()


def test_cli_compare_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from doremi.commands.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"doremi compare: error: {tmp_path / 'empty'}: not a pipeline run (expected main/<mixture>/ "
        f"with eval results or validation rows in metrics.jsonl)"
    ]
    assert not (tmp_path / "out").exists()
    r1 = _root(tmp_path / "seed1", {"uniform": BASE[0], "doremi": MIX[0]})
    assert main(["compare", str(r1), "--out", str(tmp_path / "out"), "--baseline", "tokens"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main(["compare", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert main(["compare", str(r1), "--out", str(tmp_path / "out")]) == 0
    assert "| doremi | 1 | -0.0833 | -0.5000 | 2/3 | 2/3 | 1.50x |" in capsys.readouterr().out
