"""`pipeline.searches`: k searches per proxy method on their own seeds, their averaged weights
pooled (docs/design.md section 4e, "A pooled arm"), read by the reports, the ledger and the
guardrails; a rerun with another number keeps the other layout's runs under previous/."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from data import artifact
from doremi.commands.cli import main
from doremi.pipeline import stages

pytestmark = pytest.mark.usefixtures("one_thread")


def run(stores: Path, tmp_path: Path, searches: int) -> tuple[Path, list[str]]:
    from tests.runs import pipeline_messages

    root = tmp_path / "pipe"
    sets = ["train.steps=2", "train.warmup_steps=0", "pipeline.methods=[doremi, odm]", "pipeline.skip_main=true"]
    return root, pipeline_messages(stores, tmp_path, root, [*sets, f"pipeline.searches={searches}"])


def averaged(proxy: Path, tmp_path: Path) -> np.ndarray:
    out = tmp_path / "single" / f"{proxy.parent.parent.name}-{proxy.parent.name}.json"
    out.parent.mkdir(exist_ok=True)
    return np.array(json.loads(stages.average(proxy, out).read_text())["weights"])


def test_two_searches_pool_their_weights_and_every_report_reads_both(stores, tmp_path):
    from doremi.reports.guardrails import pipeline_runs
    from doremi.reports.ledger import method_runs
    from doremi.reports.summary import weight_histories
    from trainer.records.metrics import read_jsonl

    root, _ = run(stores, tmp_path, 2)
    for where, runs in ((root / "round1", ("reference", "proxy")), (root / "methods" / "odm", ("proxy",))):
        proxies = [where / f"search{i}" / "proxy" for i in (1, 2)]
        seeds = [yaml.safe_load((p / "config.yaml").read_text())["train"]["seed"] for p in proxies]
        assert seeds[1] == seeds[0] + 1
        want = np.mean([averaged(p, tmp_path) for p in proxies], axis=0)
        assert json.loads((where / "weights.json").read_text())["weights"] == pytest.approx(
            want / want.sum(), abs=1e-15
        )
        header = artifact.read(where / "weights.json")
        assert [s.path for s in header.sources] == [str(p) for p in proxies]
        assert not any((where / r).exists() for r in runs)
    names = [name for name, _, _ in pipeline_runs(root, main=False)]
    assert names == [
        "round1/search1/reference",
        "round1/search1/proxy",
        "round1/search2/reference",
        "round1/search2/proxy",
        "methods/odm/search1/proxy",
        "methods/odm/search2/proxy",
    ]
    assert [str(p.relative_to(root)) for _, p in method_runs(root, "doremi")] == names[:4]
    assert [str(p.relative_to(root)) for _, p in method_runs(root, "odm")] == names[4:]
    logged = [
        np.array([r["weights"] for r in read_jsonl(root / "round1" / f"search{i}" / "proxy" / "domain_weights.jsonl")])
        for i in (1, 2)
    ]
    assert not np.array_equal(logged[0], logged[1])
    np.testing.assert_allclose(weight_histories(root)["doremi"], (logged[0] + logged[1]) / 2, rtol=0, atol=1e-12)


def test_a_rerun_with_one_search_keeps_the_two_searches_under_previous(stores, tmp_path):
    root, _ = run(stores, tmp_path, 2)
    pooled = (root / "round1" / "weights.json").read_bytes()
    root, messages = run(stores, tmp_path, 1)
    for stage_dir in ("round1", "methods/odm"):
        assert not list((root / stage_dir).glob("search*"))
        assert (root / "previous" / stage_dir / "search2" / "proxy" / "metrics.jsonl").is_file()
        assert (root / stage_dir / "proxy" / "metrics.jsonl").is_file()
    assert any("round1/search1: another pipeline.searches' run, kept in" in m for m in messages)
    assert (root / "round1" / "weights.json").read_bytes() != pooled
    assert artifact.read(root / "round1" / "weights.json").sources[0].path == str(root / "round1" / "proxy")


@pytest.mark.parametrize("value", ["0", "true", "'2'"])
def test_searches_must_be_a_positive_int(stores, tmp_path, capsys, value):
    from tests.runs import config_path

    cfg = config_path(stores, tmp_path / "exp")
    capsys.readouterr()
    assert main(["pipeline", str(cfg), "--set", f"pipeline.searches={value}", "--set", f"data.store_dir={stores}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline.searches: expected" in err[0], err
    assert not (tmp_path / "exp").exists()


def test_the_stage_overview_lists_every_search(tmp_path):
    from doremi.commands.config import stage_overview

    cfg = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.yaml"
    sets = [f"pipeline.run_dir={tmp_path / 'pipe'}", "pipeline.methods=[doremi, odm]", "pipeline.searches=2"]
    lines = [line for line in stage_overview(str(cfg), sets) if "search" in line]
    pipe = tmp_path / "pipe"
    assert [f"{x.split(': ', 1)[0]} -> {x.rsplit(' -> ', 1)[1]}" for x in lines] == [
        f"round 1, search 1 -> {pipe / 'round1' / 'search1' / 'reference'}",
        f"round 1, search 1 -> {pipe / 'round1' / 'search1' / 'proxy'}",
        f"round 1, search 2 -> {pipe / 'round1' / 'search2' / 'reference'}",
        f"round 1, search 2 -> {pipe / 'round1' / 'search2' / 'proxy'}",
        f"odm -> {pipe / 'methods' / 'odm' / 'search1' / 'proxy'}",
        f"odm -> {pipe / 'methods' / 'odm' / 'search2' / 'proxy'}",
    ]
    assert [x.split(": ")[1] for x in lines] == ["reference", "proxy"] * 2 + ["proxy (search 1)", "proxy (search 2)"]
