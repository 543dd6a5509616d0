"""The quickstart pipeline end to end, at a smaller size: every stage runs from nothing, the
table and report.md show the numbers the runs wrote, and a second run skips every stage."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from doremi.pipeline.pipeline import Pipeline, run_pipeline
from tests.paths import QUICKSTART, ROOT
from trainer.records.metrics import read_jsonl

SMALL = [
    "train.steps=12",
    "train.eval_every=6",
    "train.eval_sequences=32",
    "logging.progress=false",
    "checkpoint.every=0",
    "pipeline.main.train.steps=8",
    "model.d_model=32",
    "model.n_layers=2",
    "model.ffn_dim=64",
    "pipeline.main.model.d_model=48",
    "pipeline.main.model.n_layers=2",
    "pipeline.main.model.ffn_dim=96",
    # A quarter of the quickstart's BPE vocabulary: the logits and their cross entropy were 40% of
    # these runs' CPU, and nothing asserted here depends on the vocabulary's size.
    "data.tokenizer.vocab_size=512",
    "model.vocab_size=512",
    # 12 proxy steps: one Aioli round probing each of the 6 domains for one step; ADO's fits from step 2
    "mixing.aioli.rounds=1",
    "mixing.aioli.delta=1",
    "mixing.ado.warmup=2",
    "mixing.ado.refit_every=2",
    "mixing.ado.record_every=1",
]
METHODS = ("doremi", "doge", "odm", "aioli", "ado")
BASELINES = ("uniform", "tokens", "temperature2", "unimax4")


def table_rows(report: str) -> dict[str, list[str]]:
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 3 and cells[0] not in ("domain", "---"):
            rows[cells[0].strip("*")] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    sets = [*SMALL, f"pipeline.run_dir={root / 'run'}", f"data.store_dir={root / 'stores'}"]
    messages: list[str] = []
    pipe = Pipeline(QUICKSTART, sets, say=messages.append)
    pipe.run()
    return root / "run", sets, messages


def test_every_stage_ran_and_report_matches_the_runs(pipeline_run, capsys):
    run, sets, messages = pipeline_run
    assert any("round 1: proxy ..." in m for m in messages)
    results = run_pipeline(QUICKSTART, sets)  # second run: skips every stage, prints the table
    out = capsys.readouterr().out
    assert "done already" in out and "..." not in out.replace("done already", "")
    lines = out.rstrip().splitlines()
    summary = lines[max(i for i, line in enumerate(lines) if line.startswith("mixture  ")) :]
    assert len(summary) == 1 + len(METHODS) + len(BASELINES) + 4  # header, mixtures, note, blank, 2 lines
    assert max(len(line) for line in summary) <= 100, "\n".join(summary)  # the closing summary
    report = (run / "report.md").read_text()
    for png in ("domain_weights.png", "val_loss.png", "loss_vs_baseline.png"):
        head = (run / png).read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert width <= 2000 and height <= 2000, (png, width, height)  # reads at 100% zoom
        assert png in report

    rows = table_rows(report)
    header = [
        c.strip() for c in next(l for l in report.splitlines() if l.startswith("| domain")).strip("|").split("|")
    ][1:]
    weights = json.loads((run / "weights.json").read_text())
    for domain, w in zip(weights["domains"], weights["weights"]):
        assert float(rows[domain][header.index("weight: doremi")]) == pytest.approx(w, abs=5e-5)
    for mixture in (*METHODS, *BASELINES):
        final = [r for r in read_jsonl(run / "main" / mixture / "metrics.jsonl") if "val_loss" in r][-1]
        assert final["step"] == 8
        losses = [final["val_loss"][d] for d in weights["domains"]]
        for domain, loss in zip(weights["domains"], losses):
            assert float(rows[domain][header.index(f"loss: {mixture}")]) == pytest.approx(loss, abs=5e-5)
        assert float(rows["average"][header.index(f"loss: {mixture}")]) == pytest.approx(np.mean(losses), abs=5e-5)
        assert float(rows["worst case"][header.index(f"loss: {mixture}")]) == pytest.approx(max(losses), abs=5e-5)
        assert results["main"][mixture]["val_loss"] == pytest.approx(losses, abs=1e-9)
    for method in METHODS:
        proxy = run / "round1" / "proxy" if method == "doremi" else run / "methods" / method / "proxy"
        tuned = json.loads((proxy.parent / "weights.json").read_text())
        history = read_jsonl(proxy / "domain_weights.jsonl")
        assert [h["step"] for h in history] == list(range(1, 13))
        assert tuned["weights"] == pytest.approx(np.mean([h["weights"] for h in history], axis=0), abs=1e-12)
        for domain, w in zip(tuned["domains"], tuned["weights"]):
            assert float(rows[domain][header.index(f"weight: {method}")]) == pytest.approx(w, abs=5e-5)
        assert f"{method}: domain weights" in _plot_titles(run)
    ledger = report[report.index("## Compute spent to find each mixture") :]
    assert all(f"| {m} |" in ledger for m in METHODS)


def _plot_titles(run: Path) -> str:
    """The methods named in the weights figure, read back from the report's source data: the
    summary that drew it (doremi.reports.summary.weight_histories)."""
    from doremi.reports.summary import weight_histories

    return " ".join(f"{name}: domain weights" for name in weight_histories(run))


def test_changed_stage_is_redone(pipeline_run):
    run, sets, _ = pipeline_run
    messages: list[str] = []
    Pipeline(
        QUICKSTART, [*sets, "pipeline.main.train.steps=9", "pipeline.baselines=[uniform]"], say=messages.append
    ).run()
    redone = [m for m in messages if "config changed" in m]
    assert any("main run: doremi" in m for m in redone) and any("main run: uniform" in m for m in redone)
    assert any("round 1: proxy: done already" in m for m in messages)


def test_sections_a_stage_does_not_read_do_not_redo_it(pipeline_run):
    """The offline methods' `sweep` and `fit` keys (and another method's options) are no key of
    DoReMi's stages, the other proxies or the main runs: changing them redoes nothing."""
    run, sets, _ = pipeline_run
    sets = [*sets, "pipeline.main.train.steps=9", "pipeline.baselines=[uniform]"]  # as the test above left it
    Pipeline(QUICKSTART, sets, say=lambda m: None).run()
    messages: list[str] = []
    changed = ["sweep.runs=5", "fit.top_k=7", "mixing.odm.smoothing=0.5"]
    Pipeline(QUICKSTART, [*sets, *changed[:2]], say=messages.append).run()
    assert messages and all("done already" in m or "weights:" in m or "guardrails" in m for m in messages)
    messages.clear()
    Pipeline(QUICKSTART, [*sets, changed[2]], say=messages.append).run()
    redone = [m for m in messages if " ..." in m and "guardrails" not in m]
    assert redone == [m for m in redone if "odm" in m] and any("odm: proxy ..." in m for m in redone)


def test_iterated_rounds_feed_weights_forward_and_stop_on_tolerance(tmp_path):
    from trainer.config.tools import read_yaml

    run = tmp_path / "run"
    sets = [
        *SMALL,
        f"pipeline.run_dir={run}",
        f"data.store_dir={tmp_path / 'stores'}",
        "pipeline.skip_main=true",
        "pipeline.methods=[doremi]",
        "mixing.doremi.rounds=3",
        "mixing.doremi.rounds_tolerance=1.0",
        "train.steps=4",
        "train.eval_every=0",
    ]
    messages: list[str] = []
    Pipeline(QUICKSTART, sets, say=messages.append).run()
    assert (run / "round2" / "weights.json").is_file() and not (run / "round3").exists()
    assert any("converged after round 2" in m for m in messages)
    ref2 = read_yaml(run / "round2" / "reference" / "config.yaml")
    assert ref2["data"]["domain_weights"] == str(run / "round1" / "weights.json")
    assert (
        json.loads((run / "weights.json").read_text())["weights"]
        == json.loads((run / "round2" / "weights.json").read_text())["weights"]
    )


def test_the_closing_comparison_goes_to_wandb_in_the_pipeline_group(pipeline_run, monkeypatch):
    """With logging.wandb the pipeline logs its closing comparison as one run of its group: final
    per-domain losses and weights of every mixture, average and worst case as summary values."""
    import sys
    import types

    from doremi.reports.summary import log_comparison

    inits, logged, summary = [], [], {}

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def init(**kwargs):
        inits.append(kwargs)
        return types.SimpleNamespace(log=logged.append, summary=summary, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=Table, Settings=dict))
    run, sets, _ = pipeline_run
    store_dir = next(s.split("=", 1)[1] for s in sets if s.startswith("data.store_dir="))
    log_comparison(run, store_dir, ["uniform", "tokens"], "proj", "pipe")
    assert inits == [
        {
            "project": "proj",
            "name": f"pipeline:{run}",
            "group": "pipe",
            "job_type": "comparison",
            "dir": str(run),
            "resume": "allow",
            "settings": {"quiet": True},
        }
    ]
    table = logged[0]["comparison"]
    weights = json.loads((run / "weights.json").read_text())
    from doremi.outputs.stage_markers import eval_result

    final = eval_result(run / "main" / "doremi")["val_loss"]
    doremi_rows = [r for r in table.data if r[0] == "doremi"]
    assert [r[1] for r in doremi_rows] == weights["domains"]
    assert [r[2] for r in doremi_rows] == pytest.approx(final, abs=1e-12)
    assert [r[3] for r in doremi_rows] == pytest.approx(weights["weights"], abs=1e-12)
    assert summary["doremi/worst_val_loss"] == pytest.approx(max(final), abs=1e-12)


def test_methods_online_on_the_main_model_join_the_report(tmp_path):
    """`pipeline.online`: a method trained on the main model itself is a main run of its own
    (`<name>-online`), its mixture the mean of its sampling weights, its cost in the ledger."""
    run = tmp_path / "run"
    sets = [
        *SMALL,
        f"pipeline.run_dir={run}",
        f"data.store_dir={tmp_path / 'stores'}",
        "pipeline.methods=[odm]",
        "pipeline.online=[ado]",
        "pipeline.baselines=[uniform]",
    ]
    run_pipeline(QUICKSTART, sets)
    assert sorted(p.name for p in (run / "main").iterdir()) == ["ado-online", "odm", "uniform"]
    assert not (run / "round1").exists()
    history = read_jsonl(run / "main" / "ado-online" / "domain_weights.jsonl")
    assert [h["step"] for h in history] == list(range(1, 9))
    report = (run / "report.md").read_text()
    rows = table_rows(report)
    header = [
        c.strip() for c in next(l for l in report.splitlines() if l.startswith("| domain")).strip("|").split("|")
    ][1:]
    mean = np.mean([h["sampling"] for h in history], axis=0)  # what it drew with, not its next policy
    for i, domain in enumerate(history[0]["domains"]):
        assert float(rows[domain][header.index("weight: ado-online")]) == pytest.approx(mean[i], abs=5e-5)
    ledger = report[report.index("## Compute spent to find each mixture") :]
    assert "| odm |" in ledger and "| ado-online |" in ledger


def test_offline_methods_fit_one_shared_sweep(tmp_path):
    """`pipeline.methods: [regmix, mixing_law]`: one sweep of small runs (stacked), two fits of
    it, a main run on each proposal, and the sweep's compute in the ledger of both."""
    run = tmp_path / "run"
    sets = [
        *SMALL,
        f"pipeline.run_dir={run}",
        f"data.store_dir={tmp_path / 'stores'}",
        "pipeline.methods=[regmix, mixing_law]",
        "pipeline.baselines=[uniform]",
        "sweep.runs=10",
        "sweep.designs=[dirichlet, one_hot]",
        "fit.simulations=2000",
        "fit.top_k=20",
        "fit.regressor=ridge",  # 16 runs: too few for LightGBM's trees to split (it needs 40)
        # 16 runs this small rank nothing (held-out Spearman about 0): the guardrail would stop
        # the pipeline before the main runs, which this test is about.
        "pipeline.guardrails.min_fit_spearman=-1",
        # Each sweep run is evaluated at 6 points (sweep.eval_points), 8 sequences a domain instead
        # of 32: the fits and the ledger checked here read the points, not how many sequences.
        "train.eval_sequences=8",
    ]
    messages: list[str] = []
    Pipeline(QUICKSTART, sets, say=messages.append).run()
    assert sum("] sweep ..." in m for m in messages) == 1
    assert sorted(p.name for p in (run / "main").iterdir()) == ["mixing_law", "regmix", "uniform"]
    final = (run / "sweep" / "final.csv").read_text().splitlines()
    assert len(final) == 1 + 16  # 10 Dirichlet mixtures and the 6 one-hot ones
    for method in ("regmix", "mixing_law"):
        doc = json.loads((run / "methods" / method / "weights.json").read_text())
        assert doc["method"] == method and doc["n_runs"] == 16 and doc["compute"]["runs"] == 16
        assert sum(doc["weights"]) == pytest.approx(1.0)
    summary = run_pipeline(QUICKSTART, sets)  # everything done already: prints the table
    assert set(summary["main"]) == {"regmix", "mixing_law", "uniform"}
    ledger = (run / "report.md").read_text().split("## Compute spent to find each mixture")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line for line in ledger.splitlines() if line.startswith("| ")}
    assert rows["regmix"].split("|")[2:6] == rows["mixing_law"].split("|")[2:6]  # one sweep, shown for both


def test_readme_sweep_and_fit_commands(tmp_path):
    """docs/methods.md's `doremi preprocess / sweep / fit` lines on the quickstart config, through
    the console script, at this module's small size."""
    import subprocess

    sets = [
        *SMALL,
        "train.eval_sequences=8",  # 32 runs evaluated at 6 points each: a third of the sweep's CPU
        f"data.store_dir={tmp_path / 'stores'}",
        f"sweep.run_dir={tmp_path / 'sweep'}",
    ]
    extra = [a for s in sets for a in ("--set", s)]
    doremi = str(Path(sys.executable).parent / "doremi")
    for line in (
        "doremi preprocess experiments/configs/quickstart.yaml",
        "doremi sweep experiments/configs/quickstart.yaml --set sweep.runs=32",
        "doremi fit experiments/configs/quickstart.yaml --method mixing_law",
    ):
        assert line in (ROOT / "docs" / "methods.md").read_text()
        args = line.split()[1:]
        done = subprocess.run([doremi, *args, *extra], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert len((tmp_path / "sweep" / "final.csv").read_text().splitlines()) == 33
    assert json.loads((tmp_path / "sweep" / "mixing_law.json").read_text())["n_runs"] == 32


def test_the_quickstart_main_model_exports_and_generates(pipeline_run, tmp_path):
    """Issue 22's smoke test: the quickstart's main model (DoReMi's mixture) exported with its
    BPE tokenizer loads in `transformers` and generates; its logits equal the framework's."""
    transformers = pytest.importorskip("transformers")
    import torch

    from doremi.commands.hf import export
    from doremi.methods.reference import load_frozen
    from trainer.checkpoint.checkpoint import resolve_checkpoint
    from trainer.config.schema import load_config
    from trainer.parallel.context import ParallelContext

    run, _, _ = pipeline_run
    out = tmp_path / "hf"
    export(run / "main" / "doremi", out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ids = tok("def main():\n    return", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > ids.shape[1] and isinstance(tok.decode(gen[0]), str)
    ck = resolve_checkpoint(run / "main" / "doremi")
    from doremi.config import ExperimentConfig

    cfg = load_config(run / "main" / "doremi" / "config.yaml", cls=ExperimentConfig)
    ours = load_frozen(cfg, ck, ParallelContext.single())
    batch = {"input_ids": ids, "labels": torch.zeros_like(ids)}
    with torch.no_grad():
        want = ours.logits(None, batch)[..., : model.config.vocab_size]
        got = model(ids).logits
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
