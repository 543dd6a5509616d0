"""`doremi verify PATH`: a full check of any artifact the framework writes (docs/design.md
section 6b), by its header: every file's size and hash (stores, checkpoints, a reference cache,
an export), the token ids of stores against their vocabulary, a weights file against its
header (edited?) and its source run, a run directory's status and each of its checkpoints, and
each artifact inside a directory without a header of its own (a pipeline root). It returns one
line per thing checked; the first mismatch is an `ArtifactError` (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

from data import artifact
from data.code_identity import code_identity
from data.sampling.weights import mixture_from_file
from data.sampling.weights_file import WEIGHTS_FILE, is_weights_doc
from data.store.store import SPLITS, TokenStores, read_manifest, verify_contents
from trainer.checkpoint.checkpoint import META, resolve_checkpoint
from trainer.records.run_dir import RECORD_FILE


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _files(path: Path, header: artifact.Header, what: str) -> str:
    if not header.files:
        raise artifact.ArtifactError(f"{path}: the {what}' header lists no files to check")
    hashed = artifact.verify_files(path, header.files, what)
    return f"{len(header.files)} files, {_mb(hashed)} hashed"


def _stores(path: Path) -> list[str]:
    stores = TokenStores(path, read_manifest(path))
    stores.validate()
    if artifact.read(path) is None:
        raise artifact.ArtifactError(
            f"{path}: stores built before per-file hashes, nothing to verify against; `doremi preprocess CONFIG` adds them"
        )
    hashed = verify_contents(stores, once=False)
    for d in stores.domains:  # ids of every split, also those verified earlier in this process
        for split in SPLITS:
            stores.check_ids(d, split)
    n = len(artifact.read(path).files)
    return [f"ok stores {path}: {n} files, {_mb(hashed)} hashed, token ids < {stores.manifest.tokenizer['vocab_size']}"]


def _checkpoint(path: Path) -> list[str]:
    header = artifact.read(path)
    if header is None:
        meta = json.loads((path / META).read_text())
        header = artifact.Header("checkpoint", step=meta.get("step"), files=meta.get("files", {}))
    return [f"ok checkpoint {path} (step {header.step}): {_files(path, header, 'checkpoint')}"]


def _cache(path: Path, header: artifact.Header) -> list[str]:
    out = [f"ok reference cache {path}: {_files(path, header, 'reference cache')}"]
    ref = header.source("checkpoint")
    if ref is not None:
        from trainer.checkpoint.checkpoint import checkpoint_fingerprint

        if not (Path(ref.path) / META).is_file():
            out.append(f"note: its reference {ref.path} is gone: not verified")
        elif checkpoint_fingerprint(ref.path) != ref.fingerprint:
            raise artifact.ArtifactError(
                f"{path}: scored with reference {ref.path} ({ref.fingerprint}), which now holds "
                f"{checkpoint_fingerprint(ref.path)}"
            )
        else:
            out.append(f"ok its reference {ref.path} ({ref.fingerprint})")
    return out


def code_line(header: artifact.Header) -> str:
    """Which code wrote the artifact (data/code_identity.py), oldest first, and whether the code
    now running is it: `code: sources 1a2b... (commit 6a67f66, torch 2.13.0); the code here`."""
    if not header.code:
        return "code: not recorded (written before headers named their code)"

    def one(c: dict) -> str:
        commit = f"commit {c['commit'][:12]}, " if c.get("commit") else ""
        return f"sources {c.get('sources')} ({commit}torch {c.get('torch')})"

    here = code_identity()["sources"]
    same = "the code here" if header.code[-1].get("sources") == here else f"not the code here (sources {here})"
    return "code: " + ", then ".join(one(c) for c in header.code) + f"; {same}"


def _run(path: Path) -> list[str]:
    header = artifact.read(path / RECORD_FILE)
    status = "made before headers" if header is None else header.describe()
    out = [f"ok run {path}: {status}"]
    if header is not None:
        out.append(code_line(header))
    for ck in sorted((path / "checkpoints").glob("step_*")):
        if (ck / META).is_file() and ck.name.removeprefix("step_").isdigit():
            out += _checkpoint(ck)
    if (path / WEIGHTS_FILE).is_file():
        out += _weights(path / WEIGHTS_FILE)
    return out


def _weights(path: Path) -> list[str]:
    mixture_from_file(path, str(path))  # its numbers too: what a run reading it would refuse
    header = artifact.read(path)
    if header is None:
        return [f"ok weights {path}: no header (written by hand), form and numbers checked"]
    return [f"ok {header.kind} {path}: as written ({header.fingerprint}), sources checked where present"]


def verify(target: str | Path) -> list[str]:
    """Check `target` fully; one line per artifact checked."""
    path = Path(target)
    if not path.exists():
        raise artifact.ArtifactError(f"{path}: not found")
    if path.is_file():
        return _weights(path)
    header = artifact.read(path)
    if header is not None:
        artifact.check_content(path, f"its {header.kind.replace('_', ' ')} header")
    if (path / "manifest.json").is_file():
        return _stores(path)
    if (path / RECORD_FILE).is_file():
        return _run(path)
    if header is not None and header.kind == "reference_cache":
        return _cache(path, header)
    if (path / META).is_file():
        return _checkpoint(resolve_checkpoint(path))
    if header is not None and header.kind == "pipeline":
        return [f"ok pipeline {path}: {header.describe()}", *_holder(path)]
    if header is not None:
        return [f"ok {header.kind} {path}: {_files(path, header, header.kind)}"]
    return _holder(path)


class _NotAnArtifact(artifact.ArtifactError):
    pass


def _holder(path: Path) -> list[str]:
    """A directory of artifacts without a header of its own (a pipeline root, `runs/`): each
    artifact in it, in name order; refused when it holds none."""
    out = []
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            try:
                out += verify(child)
            except _NotAnArtifact:
                continue
        elif child.suffix == ".json" and is_weights_doc(child):
            out += _weights(child)
    if not out:
        raise _NotAnArtifact(
            f"{path}: not an artifact of this framework (no header, manifest, run.json or meta.json, none inside)"
        )
    return out
