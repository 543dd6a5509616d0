"""`doremi preprocess` progress (data/progress.py, issue 42 point 2): tokens and bytes per second
per domain and overall on stderr, at most every few seconds, off under pytest unless asked."""

from __future__ import annotations

import io
import json
from pathlib import Path

from data.config import DataConfig, DomainSource
from data.preprocess.preprocess import preprocess
from data.progress import ENV, Countdown, Progress, duration, interval_from_env, si


def test_lines_at_most_every_interval_with_rates_since_the_last():
    now = [0.0]
    out = io.StringIO()
    meter = Progress(["web", "code"], stream=out, interval=5.0, clock=lambda: now[0])
    now[0] = 1.0
    meter.add("web", 1000, 4000)
    assert out.getvalue() == ""
    now[0] = 5.0
    meter.add("code", 2_000_000, 6_000_000)
    now[0] = 7.0
    meter.add("code", 500, 600)
    now[0] = 10.0
    meter.absorb([10, 20, 0, 0])  # a worker's cumulative counters
    meter.absorb([10, 20, 0, 0])  # read again: nothing added
    assert out.getvalue().splitlines() == [
        "preprocess 5 s: all: 2.00 Mtok (400.20 ktok/s), 6.00 MB (1.20 MB/s)",
        "  web: 1.00 ktok (200 tok/s), 4.00 kB (800 B/s)",
        "  code: 2.00 Mtok (400.00 ktok/s), 6.00 MB (1.20 MB/s)",
        "preprocess 10 s: all: 2.00 Mtok (102 tok/s), 6.00 MB (124 B/s)",
        "  web: 1.01 ktok (2 tok/s), 4.02 kB (4 B/s)",
        "  code: 2.00 Mtok (100 tok/s), 6.00 MB (120 B/s)",
    ]
    assert meter.counts == [1010, 4020, 2_000_500, 6_000_600]


def test_interval_from_the_environment():
    assert interval_from_env({}) == 5.0
    assert interval_from_env({"PYTEST_CURRENT_TEST": "t"}) == 0.0
    assert interval_from_env({"PYTEST_CURRENT_TEST": "t", ENV: "2.5"}) == 2.5
    assert interval_from_env({ENV: "0"}) == 0.0 and interval_from_env({ENV: "x"}) == 5.0
    assert Progress(["a"]).enabled is False  # under pytest


def _config(tmp_path: Path, num_proc: int) -> DataConfig:
    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    for i in range(2):
        (d / f"web{i}.jsonl").write_text("".join(json.dumps({"text": f"web {i} {j} ünï"}) + "\n" for j in range(300)))
    (d / "notes.txt").write_text("".join(f"note {j}\n" for j in range(400)))
    domains = [
        DomainSource(name="web", paths=[str(d / "web*.jsonl")]),
        DomainSource(name="notes", paths=[str(d / "notes.txt")], sample_by="line"),
    ]
    return DataConfig(domains=domains, store_dir=str(tmp_path / f"s{num_proc}"), num_proc=num_proc)


def test_preprocess_reports_on_stderr_when_asked(tmp_path, monkeypatch, capsys):
    """In this process every batch is reported (interval 1 us): the last block holds the totals
    of the manifest; stdout stays empty."""
    monkeypatch.setenv(ENV, "0.000001")
    manifest = preprocess(_config(tmp_path, 1), progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if ": all: " in line or line.startswith("  ")]
    tokens = sum(d.train.tokens + d.validation.tokens for d in manifest.domains)
    nbytes = sum(d.train.bytes + d.validation.bytes for d in manifest.domains)
    last_all = [line for line in lines if ": all: " in line][-1]
    assert f"all: {si(tokens, 'tok')} (" in last_all and f"), {si(nbytes, 'B')} (" in last_all
    assert any(line.startswith("  web: ") for line in lines) and any(line.startswith("  notes: ") for line in lines)


def test_worker_processes_report_through_shared_counters(tmp_path, monkeypatch):
    """num_proc 2: the parent reads the workers' counters after each task; the last reading
    holds the manifest's totals."""
    seen: list[list[int]] = []
    absorb = Progress.absorb
    monkeypatch.setattr(Progress, "absorb", lambda self, shared: seen.append(list(shared)) or absorb(self, shared))
    monkeypatch.setenv(ENV, "0.01")
    manifest = preprocess(_config(tmp_path, 2), progress=True)
    web, notes = (manifest.domain(n) for n in ("web", "notes"))
    assert seen[-1] == [
        web.train.tokens + web.validation.tokens,
        web.train.bytes + web.validation.bytes,
        notes.train.tokens + notes.validation.tokens,
        notes.train.bytes + notes.validation.bytes,
    ]


def test_countdown_lines_with_elapsed_and_eta_at_most_every_interval():
    """A resumed stage (2 of 10 done before): the rate counts only the units done here."""
    now = [100.0]
    out = io.StringIO()
    countdown = Countdown("sweep", 10, first=2, stream=out, interval=5.0, clock=lambda: now[0])
    now[0] = 104.0
    countdown.done(3, "run 2 (dirichlet)")
    assert out.getvalue() == ""
    now[0] = 110.0
    countdown.done(4, "run 3 (dirichlet)")
    now[0] = 112.0
    countdown.done(5)
    now[0] = 400.0
    countdown.done(9, "run 8 (one_hot)")
    assert out.getvalue().splitlines() == [
        "sweep 4/10 run 3 (dirichlet): 10 s elapsed, ETA 30 s",
        "sweep 9/10 run 8 (one_hot): 5m 00s elapsed, ETA 43 s",
    ]
    assert Countdown("eval", 3).enabled is False  # under pytest


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 42, 59.6, 185, 3599, 7320)] == [
        "0 s",
        "42 s",
        "1m 00s",
        "3m 05s",
        "59m 59s",
        "2h 02m",
    ]


def test_datasets_bars_are_hidden_for_local_files_and_restored(tmp_path, capfd):
    """A csv domain is read by `datasets` (no streaming reader): its "Generating train split"
    bar is not shown for a local file, and `datasets`' own setting is as before afterwards."""
    import datasets

    (tmp_path / "t.csv").write_text("text\n" + "".join(f'"row {i} of text"\n' for i in range(40)))
    cfg = DataConfig(domains=[DomainSource(name="tab", paths=[str(tmp_path / "t.csv")])], store_dir=str(tmp_path / "s"))
    assert datasets.is_progress_bar_enabled()
    manifest = preprocess(cfg, progress=True)
    assert manifest.domain("tab").train.documents + manifest.domain("tab").validation.documents == 40
    err = capfd.readouterr().err
    assert "Generating" not in err and "Downloading" not in err
    assert datasets.is_progress_bar_enabled()
