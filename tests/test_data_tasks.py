"""Preprocessing as tasks per (domain, file) (data/preprocess/tasks.py, issue 42): the stores' bytes do
not depend on the number of processes nor on interruptions, and a build killed with SIGKILL
resumes from its finished tasks."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig, DomainSource, TokenizerConfig
from data.preprocess import tasks
from data.preprocess.preprocess import preprocess
from data.store.store import MANIFEST_FILE

ROOT = Path(__file__).resolve().parents[1]


def corpus(tmp_path) -> list[DomainSource]:
    """7 files in 3 domains: 7 tasks."""
    d = tmp_path / "in"
    d.mkdir()
    for i in range(3):
        rows = [{"text": f"web {i}-{j}: {'ünï ' * (j % 5)} mixture {j * j}"} for j in range(30 + i)]
        (d / f"web{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i in range(2):
        (d / f"book{i}.txt").write_text("".join(f"para {i}.{j} line one\nline two {j}\n\n" for j in range(25)))
    for i in range(2):
        pq.write_table(pa.table({"text": [f"def f{i}_{j}(): return {j}" for j in range(40)]}), d / f"code{i}.parquet")
    return [
        DomainSource(name="web", paths=[str(d / "web*.jsonl")]),
        DomainSource(name="books", paths=[str(d / "book*.txt")], sample_by="paragraph"),
        DomainSource(name="code", paths=[str(d / "code*.parquet")], max_documents=55),
    ]


def config(tmp_path, domains, name, num_proc=1) -> DataConfig:
    return DataConfig(
        domains=domains,
        store_dir=str(tmp_path / name),
        tokenizer=TokenizerConfig(kind="bpe", vocab_size=320),
        num_proc=num_proc,
        validation_fraction=0.15,
    )


def store_bytes(store: str) -> dict[str, bytes]:
    root = Path(store)
    out = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    manifest = json.loads(out.pop(MANIFEST_FILE))
    out["manifest domains"] = json.dumps([manifest["domains"], manifest["fingerprint"]]).encode()
    return out


def test_one_process_and_two_give_the_same_bytes(tmp_path, monkeypatch):
    """The second build also merges in blocks of at most 5 tokens (one longer document alone)."""
    domains = corpus(tmp_path)
    one, two = config(tmp_path, domains, "one"), config(tmp_path, domains, "two", num_proc=2)
    assert len(tasks.domain_tasks("web", *_files(one, "web"))) == 3
    preprocess(one, progress=False)
    monkeypatch.setattr(tasks, "MERGE_TOKENS", 5)
    preprocess(two, progress=False)
    a, b = store_bytes(one.store_dir), store_bytes(two.store_dir)
    assert a == b and len(a) == 3 * 4 + 2
    assert not list(Path(one.store_dir).glob(".tasks-*"))  # removed once committed


def _files(cfg, name):
    from data.sources.sources import SourceReader, plan_domains

    plan = next(p for p in plan_domains(cfg) if p.name == name)
    source = SourceReader(cfg, None).open(plan)
    return source.files, source.num_rows


def test_an_interrupted_build_resumes_from_its_finished_tasks(tmp_path, monkeypatch):
    domains = corpus(tmp_path)
    fresh, cut = config(tmp_path, domains, "fresh"), config(tmp_path, domains, "cut")
    preprocess(fresh, progress=False)
    run = tasks.run_task
    calls = []

    def interrupted(task, *args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(task.path)
        return run(task, *args)

    monkeypatch.setattr(tasks, "run_task", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(cut, progress=False)
    assert not (Path(cut.store_dir) / MANIFEST_FILE).exists()
    assert len(list(Path(cut.store_dir).glob(".tasks-*/*/*.done.json"))) == 3
    resumed = []
    monkeypatch.setattr(tasks, "run_task", lambda task, *args: resumed.append(task.path) or run(task, *args))
    preprocess(cut, progress=False)
    assert len(resumed) == 4 and not set(resumed) & set(calls)
    assert store_bytes(cut.store_dir) == store_bytes(fresh.store_dir)


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from data.preprocess import tasks
    from data.config import DataConfig, DomainSource, TokenizerConfig
    from data.preprocess.preprocess import preprocess

    cfg = DataConfig(**eval(sys.argv[1]))
    cfg.domains = [DomainSource(**d) for d in cfg.domains]
    cfg.tokenizer = TokenizerConfig(**cfg.tokenizer)
    run, done, kill_after = tasks.run_task, [], int(sys.argv[2])

    def run_task(*args):
        if len(done) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        done.append(run(*args))

    tasks.run_task = run_task
    preprocess(cfg, progress=False)
    """
)


def test_a_build_killed_twice_resumes_to_the_same_bytes(tmp_path):
    domains = corpus(tmp_path)
    fresh, killed = config(tmp_path, domains, "fresh"), config(tmp_path, domains, "killed")
    preprocess(fresh, progress=False)
    spec = {
        "domains": [vars(d) for d in domains],
        "store_dir": killed.store_dir,
        "tokenizer": {"kind": "bpe", "vocab_size": 320},
        "num_proc": 1,
        "validation_fraction": 0.15,
    }
    for kill_after, finished in ((3, 3), (2, 5)):
        proc = subprocess.run(
            [sys.executable, "-c", KILLER, repr(spec), str(kill_after)], cwd=ROOT, capture_output=True, text=True
        )
        assert proc.returncode == -9, proc.stderr
        assert len(list(Path(killed.store_dir).glob(".tasks-*/*/*.done.json"))) == finished
    preprocess(killed, progress=False)
    assert store_bytes(killed.store_dir) == store_bytes(fresh.store_dir)
    assert not [p.name for p in Path(killed.store_dir).iterdir() if p.name.startswith(".")]


def test_shares_on_several_nodes_then_the_merge_give_the_same_bytes(tmp_path, monkeypatch):
    """Three shares (as three nodes would run them: tasks 0,3,6 / 1,4 / 2,5), then `preprocess`
    merges without running a task; a share run again finds its tasks finished."""
    from data.preprocess.preprocess import preprocess_share

    domains = corpus(tmp_path)
    fresh, shared = config(tmp_path, domains, "fresh"), config(tmp_path, domains, "shared")
    preprocess(fresh, progress=False)
    assert [preprocess_share(shared, i, 3) for i in range(3)] == [(3, 3), (2, 2), (2, 2)]
    assert preprocess_share(shared, 1, 3) == (0, 2)
    assert not (Path(shared.store_dir) / MANIFEST_FILE).exists()
    monkeypatch.setattr(tasks, "run_task", lambda *a: pytest.fail("the merge ran a finished task"))
    preprocess(shared, progress=False)
    assert store_bytes(shared.store_dir) == store_bytes(fresh.store_dir)
    assert preprocess_share(shared, 0, 3) == (0, 0)  # stores up to date


def test_a_share_outside_its_count_is_refused(tmp_path):
    from data.errors import DataError
    from data.preprocess.preprocess import preprocess_share

    cfg = config(tmp_path, corpus(tmp_path), "s")
    with pytest.raises(DataError, match=r"^task share 3 of 3: expected 0 <= index < count$"):
        preprocess_share(cfg, 3, 3)
    assert not Path(cfg.store_dir).exists()


def test_the_share_tool_runs_a_share_of_a_config(tmp_path, capsys):
    """experiments/tools/preprocess_share.py, what the SLURM recipe runs on each node."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "preprocess_share_tool", ROOT / "experiments/tools/preprocess_share.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    domains = corpus(tmp_path)
    lines = ["data:", f"  store_dir: {tmp_path / 'st'}", "  tokenizer: {kind: byte}", "  num_proc: 1", "  domains:"]
    lines += [f"    - {{name: {d.name}, paths: [{d.paths[0]}], sample_by: {d.sample_by}}}" for d in domains]
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\n")
    assert tool.main([str(tmp_path / "c.yaml"), "--task", "1", "--of", "2"]) == 0
    assert capsys.readouterr().out.startswith("share 1 of 2: 3 of 3 tasks run here (0 already finished) in ")
    assert tool.main([str(tmp_path / "c.yaml"), "--task", "2", "--of", "2"]) == 2
    assert capsys.readouterr().err == "preprocess_share: error: task share 2 of 2: expected 0 <= index < count\n"
