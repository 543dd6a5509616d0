"""The README's own-data route: `experiments/configs/own_data.yaml` with one JSON-lines source per
domain (a file, a glob, a gzip file) runs preprocess, plan and the whole pipeline, sizes shrunk
with `--set` only (list indexing points the domains at the test's files)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from doremi.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "own_data.yaml"
WORDS = {
    "web": "the news of a day and a city with people who read it".split(),
    "code": "def return if else for in range self value list dict import".split(),
    "papers": "we show that the proposed method improves results on benchmarks".split(),
}


def _docs(domain: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choices(WORDS[domain], k=80))}) + "\n" for _ in range(n)]


def test_own_jsonl_files_through_the_readme_route(tmp_path, capsys):
    (tmp_path / "code").mkdir()
    (tmp_path / "web.jsonl").write_text("".join(_docs("web", 120, 1)))
    for part in range(2):
        (tmp_path / "code" / f"part{part}.jsonl").write_text("".join(_docs("code", 60, 2 + part)))
    with gzip.open(tmp_path / "papers.jsonl.gz", "wt") as f:
        f.write("".join(_docs("papers", 120, 4)))
    sets = [
        f"data.domains[0].paths=[{tmp_path / 'web.jsonl'}]",
        f"data.domains[1].paths=[{tmp_path / 'code' / '*.jsonl'}]",
        f"data.domains[2].paths=[{tmp_path / 'papers.jsonl.gz'}]",
        f"data.store_dir={tmp_path / 'stores'}",
        f"pipeline.run_dir={tmp_path / 'run'}",
        "data.tokenizer.vocab_size=300",
        "data.holdout_sequences=4",
        "data.seq_len=32",
        "model.max_seq_len=32",
        "train.steps=6",
        "train.global_batch_size=6",
        "train.eval_every=3",
        "logging.every=3",
        "pipeline.main.train.steps=4",
        "pipeline.main.model.max_seq_len=32",
    ]
    args = [x for s in sets for x in ("--set", s)]
    assert main(["config", str(CONFIG), *args]) == 0
    assert "vocab_size: auto" in capsys.readouterr().out  # no stores yet: resolved when they exist
    assert main(["preprocess", str(CONFIG), *args]) == 0
    assert main(["inspect", str(CONFIG), "-n", "2", *args]) == 0
    shown = capsys.readouterr().out
    assert all(name in shown for name in WORDS) and "news" in shown and "def" in shown
    assert main(["plan", str(CONFIG), "--gpus", "1", "--gpu-memory", "80", *args]) == 0
    assert main(["pipeline", str(CONFIG), *args]) == 0
    run = tmp_path / "run"
    weights = json.loads((run / "weights.json").read_text())
    assert weights["domains"] == ["web", "code", "papers"]
    assert abs(sum(weights["weights"]) - 1.0) < 1e-9
    report = (run / "report.md").read_text()
    assert "## What was run" in report and "| main/uniform |" in report and "| main/tokens |" in report
    assert "| tokens trained (measured) | tokens (nominal) |" in report
    assert (run / "loss_vs_baseline.png").read_bytes()[:4] == b"\x89PNG"
