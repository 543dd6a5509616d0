"""Artifact headers (issue 41, items 1-4; docs/design.md section 6b): every artifact says what
it is, whether it finished and what it was made from; every command checks before it reads and
replaces only its own output. A matrix of tampered inputs x the commands that read them: each is
refused with one line and exit status 2, and nothing is deleted or overwritten."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from data import artifact
from data.code_identity import PACKAGES, code_identity, git_commit, sources_digest
from data.store.store import read_manifest
from doremi.commands.cli import main
from doremi.pipeline import stages
from tests.runs import STORE_YAML, config
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.records import run_dir as rundir

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = "train.steps=2"


def tree(root: Path) -> dict[str, bytes]:
    """Every file's bytes under `root` (what must be unchanged after a refusal)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def contents(root: Path) -> list[bytes]:
    """The files' bytes whatever their names (a directory moved aside keeps them)."""
    return sorted(p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != rundir.LOCK_FILE)


def write_yaml(path: Path, store: Path, run: Path, edit=None) -> Path:
    raw = yaml.safe_load(STORE_YAML.format(store=store, run=run))
    if edit is not None:
        edit(raw)
    path.write_text(yaml.safe_dump(raw))
    return path


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in process: exit status 2 and one line on stderr holding every needle."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.fixture(scope="module")
def made(stores, tmp_path_factory) -> dict[str, Path]:
    """One of each artifact, made once: a reference, a proxy of it with its weights, a cache
    scored with it, and a main run on the weights."""
    root = tmp_path_factory.mktemp("made")
    ref, proxy, main_run, cache = root / "ref", root / "proxy", root / "main", root / "cache"
    stages.train_reference(config(stores, ref, STEPS))
    stages.train_proxy(config(stores, proxy, STEPS, f"mixing.doremi.reference={ref}"))
    weights = stages.average(proxy)
    stages.score(config(stores, root / "scored", STEPS, f"mixing.doremi.reference={ref}"), cache)
    stages.train(config(stores, main_run, STEPS, f"data.domain_weights={weights}"))
    return {
        "root": root,
        "stores": stores,
        "ref": ref,
        "proxy": proxy,
        "weights": weights,
        "cache": cache,
        "main": main_run,
    }


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)
    return dst


# -- headers --------------------------------------------------------------------------------


def test_every_artifact_carries_its_header(made):
    stores = artifact.read(made["stores"])
    assert stores.kind == "stores" and stores.fingerprint == read_manifest(made["stores"]).fingerprint
    assert {"noise/train.bin", "markov/validation.idx", "tokenizer.json"} <= set(stores.files)
    ref = artifact.read(made["ref"])
    assert (ref.kind, ref.status, ref.step, ref.steps) == ("run", "finished", 2, 2)
    assert ref.source("stores").fingerprint == stores.fingerprint
    proxy = artifact.read(made["proxy"])
    assert proxy.source("doremi.reference").path == str(made["ref"])
    ck = artifact.read(latest_checkpoint(made["ref"]))
    assert (ck.kind, ck.step) == ("checkpoint", 2) and "extra.pt" in ck.files
    cache = artifact.read(made["cache"])
    assert cache.kind == "reference_cache" and cache.source("checkpoint").path == str(latest_checkpoint(made["ref"]))
    weights = artifact.read(made["weights"])
    assert weights.kind == "weights" and weights.sources == [
        artifact.Source("run", str(made["proxy"]), proxy.fingerprint)
    ]
    main_run = artifact.read(made["main"])
    assert main_run.source("data.domain_weights").path == str(made["weights"])
    # and the code that wrote each: this process's, once
    for header in (stores, ref, proxy, ck, cache, weights, main_run):
        assert header.code == [code_identity()], header.kind


def test_a_rewrite_by_other_code_appends_its_identity_and_a_resume_keeps_the_first(tmp_path, monkeypatch):
    import data.artifact as artifact_module

    artifact.write(tmp_path, artifact.Header("export", fingerprint="abc"))
    first = artifact.read(tmp_path).code
    assert first == [code_identity()]
    other = {**code_identity(), "sources": "0" * 16}
    monkeypatch.setattr(artifact_module, "code_identity", lambda: other)
    header = artifact.read(tmp_path)
    artifact.write(tmp_path, header)
    artifact.write(tmp_path, artifact.read(tmp_path))  # the same code again: recorded once
    assert artifact.read(tmp_path).code == [*first, other]
    # run.json of a resumed run (same fingerprint) keeps what trained its first steps; a new run does not
    run = tmp_path / "run"
    run.mkdir()
    rundir.write_record(run, {"fingerprint": "f1"}, "running", 0, 4, [])
    monkeypatch.setattr(artifact_module, "code_identity", lambda: {**other, "sources": "1" * 16})
    rundir.write_record(run, {"fingerprint": "f1"}, "running", 2, 4, [])
    assert [c["sources"] for c in artifact.read(run).code] == ["0" * 16, "1" * 16]
    rundir.write_record(run, {"fingerprint": "f2"}, "running", 0, 4, [])
    assert [c["sources"] for c in artifact.read(run).code] == ["1" * 16]
    # a header made before this field reads as written by unknown code
    doc = json.loads((tmp_path / artifact.HEADER_FILE).read_text())
    del doc[artifact.HEADER_KEY]["code"]
    (tmp_path / artifact.HEADER_FILE).write_text(json.dumps(doc))
    assert artifact.read(tmp_path).code == []


def test_the_code_identity_is_the_sources_and_the_checked_out_commit(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg / "sub").mkdir(parents=True)
        (tmp_path / pkg / "sub" / "m.py").write_text(f"X = '{pkg}'\n")
    digest = sources_digest(tmp_path)
    (tmp_path / "data" / "__pycache__").mkdir()
    (tmp_path / "data" / "__pycache__" / "m.py").write_text("cached")
    (tmp_path / "data" / "notes.md").write_text("not a source")
    assert sources_digest(tmp_path) == digest
    (tmp_path / "trainer" / "sub" / "m.py").write_text("X = 'changed'\n")
    assert sources_digest(tmp_path) != digest
    # the commit: a branch's ref file, a packed ref, a detached head, a worktree's .git file
    assert git_commit(tmp_path) is None
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert git_commit(tmp_path) == "a" * 40
    (git / "refs" / "heads" / "main").write_text("b" * 40 + "\n")
    assert git_commit(tmp_path) == "b" * 40
    tree = tmp_path / "wt"
    (git / "worktrees" / "wt").mkdir(parents=True)
    (git / "worktrees" / "wt" / "HEAD").write_text("c" * 40 + "\n")
    (git / "worktrees" / "wt" / "commondir").write_text("../..\n")
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {git / 'worktrees' / 'wt'}\n")
    assert git_commit(tree) == "c" * 40


def test_header_require_names_both_sides(tmp_path):
    artifact.write(tmp_path, artifact.Header("export", status="running", fingerprint="abc"))
    with pytest.raises(artifact.ArtifactError, match=r"holds a export, expected a run"):
        artifact.require(tmp_path, "run")
    with pytest.raises(artifact.ArtifactError, match=r"did not finish \(export running\)"):
        artifact.require(tmp_path, "export")
    with pytest.raises(artifact.ArtifactError, match=r"fingerprint abc, expected xyz"):
        artifact.require(tmp_path, "export", finished=False, fingerprint="xyz")
    with pytest.raises(artifact.ArtifactError, match="no artifact header"):
        artifact.require(tmp_path / "none", "run", legacy_ok=False)


# -- stores: the config's data section, bytes, ids -------------------------------------------


def _reorder(raw):
    raw["data"]["domains"] = raw["data"]["domains"][::-1]


def _remove(raw):
    raw["data"]["domains"] = raw["data"]["domains"][:2]


def _source(raw):
    raw["data"]["domains"][0]["synthetic"]["seed"] = 99


def _split(raw):
    raw["data"]["validation_fraction"] = 0.2


def _tokenizer(raw):
    raw["data"]["tokenizer"] = {"kind": "bpe", "vocab_size": 300}


CONFIG_CASES = {
    "reordered": (_reorder, "order of the domains"),
    "removed": (_remove, "domain 'markov' removed"),
    "source": (_source, "domain 'noise' source"),
    "split": (_split, "changed: split"),
    "tokenizer": (_tokenizer, "changed: tokenizer"),
}
STAGES = ["train", "train-reference", "train-proxy", "score"]


@pytest.mark.parametrize("command", STAGES)
@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_stages_refuse_stores_built_from_another_data_section(made, tmp_path, capsys, command, case):
    edit, needle = CONFIG_CASES[case]
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run", edit)
    argv = [command, cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={made['ref']}"]
    argv += ["--out", tmp_path / "cache"] if command == "score" else []
    before = tree(made["stores"])
    refused(capsys, argv, "stores built from other inputs than the config's data section", needle)
    assert tree(made["stores"]) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


def _edit_byte(store: Path) -> str:
    path = store / "easy" / "train.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    return "content changed"


def _truncate(store: Path) -> str:
    path = store / "markov" / "train.bin"
    path.write_bytes(path.read_bytes()[:-2])
    return "truncated"


def _move_offset(store: Path) -> str:
    path = store / "noise" / "validation.idx"
    idx = np.fromfile(path, dtype="<i8")
    idx[1] += 1
    idx.tofile(path)
    return "content changed"


def _out_of_vocab(store: Path) -> str:
    """An id beyond the vocabulary with the header rewritten to match (a build bug, not damage)."""
    path = store / "easy" / "train.bin"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[5] = 300
    tokens.tofile(path)
    header = artifact.read(store)
    header.files["easy/train.bin"] = artifact.file_entry(path)
    artifact.write(store / "manifest.json", header, json.loads((store / "manifest.json").read_text()))
    return "easy/train.bin: domain 'easy': token id 300 at position 5 is outside the vocabulary"


def _edit_manifest(store: Path) -> str:
    doc = json.loads((store / "manifest.json").read_text())
    doc["domains"][1]["entropy"] = 0.5
    (store / "manifest.json").write_text(json.dumps(doc))
    return "manifest.json: edited since it was written"


STORE_CASES = {
    "edited": _edit_byte,
    "truncated": _truncate,
    "moved offset": _move_offset,
    "out of vocabulary": _out_of_vocab,
    "edited manifest": _edit_manifest,
}


@pytest.mark.parametrize("command", [*STAGES, "eval", "verify"])
@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_damaged_stores_are_refused_by_every_reader(made, tmp_path, capsys, command, case):
    store = copy(made["stores"], tmp_path / "stores")
    needle = STORE_CASES[case](store)
    before = tree(tmp_path)
    if command == "eval":
        run = copy(made["main"], tmp_path / "run")
        raw = yaml.safe_load((run / "config.yaml").read_text())
        raw["data"]["store_dir"] = str(store)
        (run / "config.yaml").write_text(yaml.safe_dump(raw))
        before = tree(tmp_path)
        argv = ["eval", run]
    elif command == "verify":
        argv = ["verify", store]
    else:
        cfg = write_yaml(tmp_path / "exp.yaml", store, tmp_path / "run")
        before = tree(tmp_path)
        argv = [command, cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={made['ref']}"]
        argv += ["--out", tmp_path / "cache"] if command == "score" else []
    refused(capsys, argv, needle)
    assert tree(tmp_path) == before


def test_stores_before_hashes_are_read_with_a_note_and_preprocess_adds_them(made, tmp_path, capsys):
    from data.preprocess.preprocess import preprocess
    from data.store.store import open_stores

    store = copy(made["stores"], tmp_path / "stores")
    doc = json.loads((store / "manifest.json").read_text())
    del doc["artifact"]
    (store / "manifest.json").write_text(json.dumps(doc))
    capsys.readouterr()
    open_stores(store)
    assert "stores built before per-file hashes, contents not verified" in capsys.readouterr().err
    preprocess(config(store, tmp_path / "unused").data, progress=False)
    assert artifact.read(store).files == artifact.read(made["stores"]).files


# -- runs: a reference or proxy that did not finish ------------------------------------------


def _killed(run: Path) -> None:
    rundir.mark(run, "running", 0)


def _interrupted(run: Path) -> None:
    rundir.mark(run, "interrupted", 1)


@pytest.mark.parametrize("command", ["train-proxy", "score"])
@pytest.mark.parametrize("how", ["killed", "interrupted", "training"])
def test_a_proxy_or_score_refuses_a_reference_that_did_not_finish(made, tmp_path, capsys, command, how):
    ref = copy(made["ref"], tmp_path / "ref")
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    argv = [command, cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={ref}"]
    argv += ["--out", tmp_path / "cache"] if command == "score" else []
    if how == "training":  # another job holds the lock
        fd = os.open(ref / rundir.LOCK_FILE, os.O_RDWR | os.O_CREAT)
        os.write(fd, b"4242\n")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            before = tree(tmp_path)
            refused(capsys, argv, f"{ref}: the reference is still training (pid 4242")
        finally:
            os.close(fd)
    else:
        {"killed": _killed, "interrupted": _interrupted}[how](ref)
        before = tree(tmp_path)
        want = "(run running at step 2 of 2; killed?)" if how == "killed" else "(run interrupted at step 1 of 2)"
        refused(capsys, argv, f"{ref}: the reference did not finish {want}")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_average_refuses_an_unfinished_proxy_unless_told_and_then_records_it(made, tmp_path, capsys, how):
    proxy = copy(made["proxy"], tmp_path / "proxy")
    (proxy / "weights.json").unlink()
    {"killed": _killed, "interrupted": _interrupted}[how](proxy)
    want = "run running at step 2 of 2; killed?" if how == "killed" else "run interrupted at step 1 of 2"
    before = tree(tmp_path)
    refused(capsys, ["average", proxy], f"the proxy did not finish ({want})", "--allow-unfinished")
    assert tree(tmp_path) == before
    assert main(["average", str(proxy), "--allow-unfinished"]) == 0
    header = artifact.read(proxy / "weights.json")
    assert header.notes == [f"--allow-unfinished: averaged a run that did not finish ({want.split(';')[0]})"]


def _cut(path: Path) -> Path:
    """`path` cut short mid-document (a copy that stopped, a full disk)."""
    path.write_bytes(path.read_bytes()[:60])
    return path


@pytest.mark.parametrize("command", ["average", "score", "train-proxy on a cache"])
def test_damaged_metadata_is_refused_not_read_as_made_before_headers(made, tmp_path, capsys, command):
    """A run.json or a cache's meta.json that is not valid JSON was read as "no header" (legacy,
    not checked): an unfinished proxy averaged, an unfinished reference scored, a traceback."""
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    if command == "average":
        damaged = _cut(copy(made["proxy"], tmp_path / "proxy") / "run.json")
        argv = ["average", tmp_path / "proxy", "--out", tmp_path / "w.json"]
    elif command == "score":
        damaged = _cut(copy(made["ref"], tmp_path / "ref") / "run.json")
        argv = ["score", cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={tmp_path / 'ref'}"]
        argv += ["--out", tmp_path / "cache"]
    else:
        damaged = _cut(copy(made["cache"], tmp_path / "cache") / "meta.json")
        argv = _proxy_on_cache(made, tmp_path, tmp_path / "cache")
    before = tree(tmp_path)
    refused(capsys, argv, f"{damaged}: damaged metadata, not valid JSON")
    assert tree(tmp_path) == before


def test_average_refuses_a_proxy_without_its_config(made, tmp_path, capsys):
    """Without config.yaml, `average` fell back to step 1 and method `doremi` for any proxy."""
    proxy = copy(made["proxy"], tmp_path / "proxy")
    (proxy / "config.yaml").unlink()
    before = tree(tmp_path)
    refused(capsys, ["average", proxy, "--out", tmp_path / "w.json"], f"{proxy / 'config.yaml'}: missing")
    assert tree(tmp_path) == before


# -- weights: edited by hand, or made from another proxy -------------------------------------


def _weights_run(made: Path, tmp_path: Path, weights: Path) -> list:
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    return ["train", cfg, "--set", STEPS, "--set", f"data.domain_weights={weights}"]


@pytest.mark.parametrize("edit", ["weights", "reordered domains"])
def test_an_edited_weights_file_is_named_edited_and_refused_unless_it_says_so(made, tmp_path, capsys, edit):
    weights = copy(made["weights"], tmp_path / "weights.json")
    doc = json.loads(weights.read_text())
    if edit == "weights":
        doc["weights"] = [0.5, 0.25, 0.25]
    else:
        doc["domains"], doc["weights"] = doc["domains"][::-1], doc["weights"][::-1]
    weights.write_text(json.dumps(doc))
    argv = _weights_run(made, tmp_path, weights)
    before = tree(tmp_path)
    refused(capsys, argv, f"{weights}: edited: its domains or weights are not those written by the weights step")
    assert tree(tmp_path) == before
    weights.write_text(json.dumps({**doc, "accept_edited": True}))
    assert main([str(a) for a in argv]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["keys"]["data.domain_weights (content)"] == rundir.content_id(str(weights))


def test_weights_of_a_proxy_trained_again_are_refused(made, tmp_path, capsys):
    proxy = copy(made["proxy"], tmp_path / "proxy")
    weights = proxy / "weights.json"
    doc = json.loads(weights.read_text())
    doc["artifact"]["sources"][0]["path"] = str(proxy)
    weights.write_text(json.dumps(doc))
    record = json.loads((proxy / "run.json").read_text())
    record["artifact"]["fingerprint"] = "0123456789abcdef"  # the proxy trained again under other keys
    (proxy / "run.json").write_text(json.dumps(record))
    argv = _weights_run(made, tmp_path, weights)
    before = tree(tmp_path)
    refused(capsys, argv, f"made from run {proxy}", "which now holds another run (0123456789abcdef)")
    assert tree(tmp_path) == before


# -- reference caches -------------------------------------------------------------------------


def _proxy_on_cache(made, tmp_path: Path, cache: Path, *sets: str) -> list:
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    return [
        "train-proxy",
        cfg,
        "--set",
        STEPS,
        "--set",
        f"mixing.doremi.reference_cache={cache}",
        *sum((["--set", s] for s in sets), []),
    ]


def test_a_cache_whose_reference_was_trained_again_is_refused_without_doremi_reference(made, tmp_path, capsys):
    ref = copy(made["ref"], tmp_path / "ref")
    cache = tmp_path / "cache"
    stages.score(config(made["stores"], tmp_path / "scored", STEPS, f"mixing.doremi.reference={ref}"), cache)
    stages.train_reference(config(made["stores"], ref, STEPS, "train.seed=7", "checkpoint.start_over=true"))
    argv = _proxy_on_cache(made, tmp_path, cache)
    before = tree(tmp_path)
    refused(capsys, argv, "cache was scored with reference", "(run `doremi score` again)")
    assert tree(tmp_path) == before


def test_a_cache_whose_reference_is_gone_cannot_be_verified(made, tmp_path, capsys):
    cache = copy(made["cache"], tmp_path / "cache")
    doc = json.loads((cache / "meta.json").read_text())
    doc["reference"] = str(tmp_path / "gone" / "checkpoints" / "step_0000002")
    (cache / "meta.json").write_text(json.dumps(doc))
    argv = _proxy_on_cache(made, tmp_path, cache)
    before = tree(tmp_path)
    refused(capsys, argv, "cannot verify the cache: its reference", "is gone")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["train-proxy", "verify"])
def test_an_edited_cache_array_is_refused(made, tmp_path, capsys, command):
    cache = copy(made["cache"], tmp_path / "cache")
    arr = cache / "markov.npy"
    data = bytearray(arr.read_bytes())
    data[-1] ^= 1
    arr.write_bytes(bytes(data))
    argv = _proxy_on_cache(made, tmp_path, cache) if command == "train-proxy" else ["verify", cache]
    before = tree(tmp_path)
    refused(capsys, argv, f"{arr}: content changed")
    assert tree(tmp_path) == before


# -- deleting only our own --------------------------------------------------------------------


@pytest.mark.parametrize("target", ["finished run", "folder of files", "the reference", "a file"])
def test_score_replaces_only_a_reference_cache(made, tmp_path, capsys, target):
    ref = copy(made["ref"], tmp_path / "ref")
    out = {
        "finished run": lambda: copy(made["main"], tmp_path / "out"),
        "folder of files": lambda: (tmp_path / "out").mkdir() or (tmp_path / "out" / "notes.txt").write_text("mine"),
        "the reference": lambda: ref,
        "a file": lambda: (tmp_path / "out").write_text("mine"),
    }[target]()
    out = ref if target == "the reference" else tmp_path / "out"
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    before = tree(tmp_path)
    refused(
        capsys,
        ["score", cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={ref}", "--out", out],
        "`doremi score` replaces only its own output",
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize("target", ["stores", "cache", "folder of files"])
def test_a_run_refuses_a_directory_that_is_not_a_run(made, tmp_path, capsys, target):
    """`train.run_dir` naming stores, a cache or someone's folder: the run wrote its config.yaml,
    run.json, metrics and lock into it (a cache then read as a run), even with start_over."""
    out = {
        "stores": lambda: copy(made["stores"], tmp_path / "out"),
        "cache": lambda: copy(made["cache"], tmp_path / "out"),
        "folder of files": lambda: (tmp_path / "out").mkdir() or (tmp_path / "out" / "config.txt").write_text("mine"),
    }[target]()
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], out)
    want = {"stores": "holds a stores, not a run", "cache": "holds a reference cache, not a run"}
    for sets in ([], ["--set", "checkpoint.start_over=true"]):
        before = tree(tmp_path)
        refused(
            capsys,
            ["train", cfg, "--set", STEPS, *sets],
            f"{out}: ",
            want.get(target, "'config.txt', which no run wrote"),
        )
        assert tree(tmp_path) == before and not (out / rundir.LOCK_FILE).exists()


@pytest.mark.parametrize("command", ["eval", "export", "score"])
def test_a_cache_named_as_a_checkpoint_is_named_by_its_kind(made, tmp_path, capsys, command):
    """A reference cache has a meta.json too: it was read as a checkpoint and refused for a
    missing config.yaml or model section, naming neither the cache nor what was expected."""
    cache = made["cache"]
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    argv = {
        "eval": ["eval", cache],
        "export": ["export", cache, tmp_path / "hf"],
        "score": ["score", cfg, "--set", STEPS, "--set", f"mixing.doremi.reference={cache}", "--out", tmp_path / "c"],
    }[command]
    before = tree(tmp_path)
    refused(capsys, argv, f"{cache}: holds a reference cache, expected a checkpoint directory or a run directory")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["sweep", "pipeline"])
@pytest.mark.parametrize("target", ["stores", "folder of files"])
def test_sweep_and_pipeline_refuse_a_root_that_is_not_theirs(made, tmp_path, capsys, command, target):
    """`sweep.run_dir` or `pipeline.run_dir` naming stores or someone's folder: the sweep
    overwrote its `losses.csv`, the pipeline its `report.md`, and both wrote into the stores."""
    out = tmp_path / "out"
    if target == "stores":
        copy(made["stores"], out)
    else:
        out.mkdir()
        (out / ("losses.csv" if command == "sweep" else "report.md")).write_text("mine")
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run")
    key = "sweep.run_dir" if command == "sweep" else "pipeline.run_dir"
    before = tree(tmp_path)
    kind = command
    want = f"holds a stores, not a {kind}" if target == "stores" else f"not written by a {kind} (no header)"
    refused(capsys, [command, cfg, "--set", STEPS, "--set", f"{key}={out}"], f"{out}: ", want, key)
    assert tree(tmp_path) == before and not (out / rundir.LOCK_FILE).exists()


def test_score_replaces_its_own_cache(made, tmp_path):
    cache = copy(made["cache"], tmp_path / "cache")
    stages.score(config(made["stores"], tmp_path / "scored", STEPS, f"mixing.doremi.reference={made['ref']}"), cache)
    assert artifact.read(cache).status == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "scored.yaml"]


def test_export_force_refuses_a_run(made, tmp_path, capsys):
    out = copy(made["main"], tmp_path / "out")
    before = tree(tmp_path)
    refused(
        capsys,
        ["export", made["main"], out, "--force", "--no-tokenizer"],
        "`doremi export --force` replaces only its own output",
    )
    assert tree(tmp_path) == before


def test_average_out_refuses_a_file_that_is_not_weights(made, tmp_path, capsys):
    proxy = copy(made["proxy"], tmp_path / "proxy")
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    before = tree(tmp_path)
    refused(capsys, ["average", proxy, "--out", tmp_path / "notes.json"], "exists and is not a weights file")
    assert tree(tmp_path) == before


def test_a_checkpoint_without_meta_is_moved_aside_and_the_run_does_not_restart_over_it(made, tmp_path, capsys):
    """An interrupted copy of a run: its only checkpoint lacks meta.json. It was deleted and the
    run restarted from step 0 over its metrics; now it is set aside (one line) and the start is
    refused, every byte kept."""
    run = copy(made["main"], tmp_path / "run")
    (latest_checkpoint(run) / "meta.json").unlink()
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], run)
    kept = contents(tmp_path)
    capsys.readouterr()
    assert main(["train", str(cfg), "--set", STEPS, "--set", f"data.domain_weights={made['weights']}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "step_0000002: checkpoint without meta.json (incomplete copy?), moved aside to" in err[0]
    assert "no complete checkpoint, only step_0000002.incomplete-" in err[1]
    assert contents(tmp_path) == kept
    capsys.readouterr()
    assert main(["train", str(cfg), "--set", STEPS, "--set", f"data.domain_weights={made['weights']}"]) == 2
    assert contents(tmp_path) == kept  # and again on the next start


def test_an_incomplete_newer_checkpoint_is_set_aside_and_the_run_resumes_from_the_complete_one(made, tmp_path, capsys):
    run = copy(made["main"], tmp_path / "run")
    ck = latest_checkpoint(run)
    copy(ck, ck.with_name("step_0000009"))
    (ck.with_name("step_0000009") / "meta.json").unlink()
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], run)
    capsys.readouterr()
    sets = ["--set", "train.steps=3", "--set", "train.extend=continue_at_min_lr"]
    assert main(["train", str(cfg), *sets, "--set", f"data.domain_weights={made['weights']}"]) == 0
    assert "step_0000009: checkpoint without meta.json" in capsys.readouterr().err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[:2] == ["step_0000002", "step_0000003"] and names[2].startswith("step_0000009.incomplete-")


# -- doremi verify ----------------------------------------------------------------------------


def test_verify_checks_every_kind(made, capsys):
    for key, first in [
        ("stores", "ok stores"),
        ("ref", "ok run"),
        ("cache", "ok reference cache"),
        ("weights", "ok weights"),
        ("main", "ok run"),
    ]:
        capsys.readouterr()
        assert main(["verify", str(made[key])]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith(f"{first} {made[key]}"), out
        if first == "ok run":  # and which code wrote it
            assert out[1].startswith(f"code: sources {code_identity()['sources']} (") and out[1].endswith(
                "; the code here"
            ), out
    assert main(["verify", str(latest_checkpoint(made["ref"]))]) == 0
    assert "ok checkpoint" in capsys.readouterr().out
    assert main(["verify", str(made["root"])]) == 0  # a folder of artifacts: each one inside
    out = capsys.readouterr().out
    assert out.count("ok run ") == 3 and "ok reference cache" in out and "ok weights" in out


@pytest.mark.parametrize("weights", [[-0.5, 1.0, 0.5], [float("nan"), 0.5, 0.5], [0.2, 0.2, 0.2]])
def test_verify_checks_the_numbers_of_a_hand_written_weights_file(tmp_path, capsys, weights):
    """`verify` said "ok" of weights every run refuses (negative, NaN, not summing to 1)."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"domains": ["noise", "easy", "markov"], "weights": weights}))
    refused(capsys, ["verify", path], str(path), "weights")
    path.write_text(json.dumps({"domains": ["noise", "easy", "markov"], "weights": [0.5, 0.25, 0.25]}))
    assert main(["verify", str(path)]) == 0


def test_verify_refuses_an_edited_checkpoint_and_a_foreign_directory(made, tmp_path, capsys):
    run = copy(made["ref"], tmp_path / "ref")
    f = latest_checkpoint(run) / "extra.pt"
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(bytes(data))
    refused(capsys, ["verify", run], f"{f}: content changed")
    (tmp_path / "other").mkdir()
    refused(capsys, ["verify", tmp_path / "other"], "not an artifact of this framework")


def test_preprocess_refuses_a_folder_that_is_not_stores(tmp_path, capsys):
    """Its domain folders replace folders of the same name: a user's folder named like a domain
    would be removed; now a store directory without a manifest may hold only our files."""
    store = tmp_path / "stores"
    (store / "easy").mkdir(parents=True)
    (store / "easy" / "thesis.tex").write_text("mine")
    cfg = write_yaml(tmp_path / "exp.yaml", store, tmp_path / "run")
    before = tree(tmp_path)
    refused(capsys, ["preprocess", cfg, "--force"], "data.store_dir holds 'easy', which is not part of token stores")
    assert tree(tmp_path) == before


# -- sweeps and fits --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(stores, tmp_path_factory) -> Path:
    from doremi.offline.sweep import run_sweep

    root = tmp_path_factory.mktemp("sweep")
    return run_sweep(config(stores, root / "run", f"sweep.run_dir={root / 's'}", "sweep.runs=6", STEPS))


def _fit_argv(made, tmp_path: Path, sweep_dir: Path, edit=None) -> list:
    cfg = write_yaml(tmp_path / "exp.yaml", made["stores"], tmp_path / "run", edit)
    out = ["fit", cfg, "--method", "mixing_law", "--sweep", sweep_dir, "--out", tmp_path / "fit.json"]
    return [*out, "--set", "fit.mixing_law.variant=direct"]  # a 2-step sweep has no curve to extrapolate


def test_a_fit_records_its_sweep(made, sweep, tmp_path):
    header = artifact.read(sweep)
    assert (header.kind, header.status, header.step, header.steps) == ("sweep", "finished", 6, 6)
    assert main([str(a) for a in _fit_argv(made, tmp_path, sweep)]) == 0
    fit = artifact.read(tmp_path / "fit.json")
    assert fit.kind == "fit" and fit.sources == [artifact.Source("sweep", str(sweep), header.fingerprint)]


def _edit_table(root: Path) -> str:
    path = root / "final.csv"
    path.write_text(path.read_text().replace(",", ",0", 1))
    return f"{path}: "


def _unfinish(root: Path) -> str:
    header = artifact.read(root)
    header.status, header.step = "running", 4
    artifact.write(root / "sweep.json", header, json.loads((root / "sweep.json").read_text()))
    return "the sweep did not finish (4 of 6 runs)"


@pytest.mark.parametrize("case", ["edited table", "unfinished", "reordered domains"])
def test_fit_refuses_a_sweep_edited_unfinished_or_of_other_stores(made, sweep, tmp_path, capsys, case):
    root = copy(sweep, tmp_path / "s")
    edit = None
    if case == "edited table":
        needle = _edit_table(root)
    elif case == "unfinished":
        needle = _unfinish(root)
    else:
        edit, needle = _reorder, "order of the domains"
    argv = _fit_argv(made, tmp_path, root, edit)
    before = tree(tmp_path)
    refused(capsys, argv, needle)
    assert tree(tmp_path) == before
    if case == "unfinished":
        assert main([str(a) for a in argv] + ["--allow-unfinished"]) == 0
        assert artifact.read(tmp_path / "fit.json").notes[0].startswith("--allow-unfinished: fitted a sweep")


def test_average_pools_several_proxies_into_the_mean_of_their_averages(made, tmp_path, capsys):
    """`doremi average P1 P2 --out F`: the mean of each proxy's averaged weights, made from both
    (docs/design.md section 4e: the study's pooled arm); without --out, refused."""
    other = tmp_path / "proxy2"
    stages.train_proxy(config(made["stores"], other, STEPS, f"mixing.doremi.reference={made['ref']}", "data.seed=7"))
    before = tree(tmp_path)
    refused(capsys, ["average", made["proxy"], other], "--out is required with several runs")
    twice = ["average", made["proxy"], other, f"{other}/", "--out", tmp_path / "w.json"]
    refused(capsys, twice, f"{other}/: given twice (as {other}); pool each run once")
    assert tree(tmp_path) == before
    out = tmp_path / "pooled" / "weights.json"
    assert main(["average", str(made["proxy"]), str(other), "--out", str(out)]) == 0
    singles = [json.loads(stages.average(p, tmp_path / f"{p.name}.json").read_text()) for p in (made["proxy"], other)]
    assert singles[0]["weights"] != singles[1]["weights"]
    doc = json.loads(out.read_text())
    want = np.mean([s["weights"] for s in singles], axis=0)
    assert doc["weights"] == pytest.approx((want / want.sum()).tolist(), abs=1e-15)
    assert doc["pooled_runs"] == 2 and doc["source"] == [str(made["proxy"]), str(other)]
    header = artifact.read(out)
    assert [(s.kind, s.path) for s in header.sources] == [("run", str(made["proxy"])), ("run", str(other))]
    assert main(["verify", str(out)]) == 0
