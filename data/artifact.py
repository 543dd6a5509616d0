"""Artifact headers: what every file or directory the framework writes says about itself, and
the checks a command makes before it reads, replaces or removes one (docs/design.md section 6b).

A header holds the artifact's `kind`, the header `format`, its `status` (`running`, `finished`
at `step` of `steps`, `interrupted`), the `fingerprint` of what determines its content, the
`sources` it was made from (kind, path and fingerprint of each), its files' sizes and
XXH3-64 hashes, and the `code` that wrote it (data/code_identity.py). It lives inside the metadata file the artifact already has (`manifest.json`,
`run.json`, a checkpoint's or a cache's `meta.json`, a weights JSON) under the key `artifact`,
or in `artifact.json` for an artifact without one (an export). This module alone writes and
reads that key; the modules that own each format ask it.

Files are hashed with XXH3-64 (xxhash), several GB/s: the checkpoint's hash, one owner
(`file_hash`). Stores hash each file once per process (`verify_files` with `once=True`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from data.atomic import atomic_write_text
from data.code_identity import code_identity
from data.errors import DataError

HEADER_FORMAT = 1
HEADER_KEY = "artifact"
HEADER_FILE = "artifact.json"
HASH_KEY = "xxh3_64"
KINDS = ("stores", "run", "checkpoint", "reference_cache", "weights", "sweep", "fit", "pipeline", "export")
STATUSES = ("running", "finished", "interrupted")
#: The metadata file that holds a directory artifact's header, looked for in this order.
METADATA_FILES = ("manifest.json", "run.json", "meta.json", "sweep.json", HEADER_FILE)


class ArtifactError(DataError):
    """An artifact of another kind, unfinished, made from other inputs, edited or damaged: one
    line naming the artifact and both sides of the mismatch."""


@dataclass(frozen=True)
class Source:
    """An artifact this one was made from, as it was when it was used."""

    kind: str
    path: str
    fingerprint: str | None


@dataclass
class Header:
    kind: str
    status: str = "finished"
    fingerprint: str | None = None
    step: int | None = None
    steps: int | None = None
    sources: list[Source] = field(default_factory=list)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What the command that wrote it was told to accept (an unfinished proxy, edited weights).
    notes: list[str] = field(default_factory=list)
    #: The hash of the document holding the header, less the header (`embed`): a hand edit of
    #: a manifest or a run.json is told apart from the file as written (`check_content`).
    content: str | None = None
    #: Every code that wrote this artifact, oldest first (data/code_identity.py): a new header
    #: starts with this process's, and a rewrite by other code (a resumed run) appends its own.
    code: list[dict[str, Any]] = field(default_factory=lambda: [code_identity()])
    format: int = HEADER_FORMAT

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.status not in STATUSES:
            raise ValueError(f"artifact header: kind {self.kind!r} / status {self.status!r} unknown")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Header:
        try:
            sources = [Source(**s) for s in raw.get("sources", [])]
            return cls(**{**dict(raw), "sources": sources, "code": list(raw.get("code", []))})
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: not a valid artifact header ({e})") from None

    def stamp(self) -> None:
        """Record this process's code as the latest to write the artifact (once in a row)."""
        here = code_identity()
        if not self.code or self.code[-1] != here:
            self.code.append(here)

    def source(self, kind: str) -> Source | None:
        return next((s for s in self.sources if s.kind == kind), None)

    def describe(self) -> str:
        """`a proxy run finished at step 300`, `a run interrupted at step 61 of 300`."""
        at = "" if self.step is None else f" at step {self.step}" + (f" of {self.steps}" if self.steps else "")
        return f"{self.kind.replace('_', ' ')} {self.status}{at}"


# -- hashes --------------------------------------------------------------------------------


HASH_CHUNK = 1 << 24


def file_hash(path: str | os.PathLike) -> str:
    """The XXH3-64 hash of a file's bytes, read in 16 MiB chunks into one reused buffer: a memory
    map of the whole file would count every page of multi-GB stores in the process's resident
    set (issue 42: preprocessing in bounded memory); the streaming hash equals the one-shot one."""
    h = xxhash.xxh3_64()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """A file's size and hash, as headers record them."""
    return {"bytes": Path(path).stat().st_size, HASH_KEY: file_hash(path)}


def hash_files(root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {n: file_entry(root / n) for n in sorted(names)}


def content_hash(value: Any) -> str:
    """The hash of a JSON value (sorted keys): a weights file's domains and weights, so that a
    hand edit is told apart from the file as written."""
    return xxhash.xxh3_64(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


_verified: set[tuple[str, int, int, str]] = set()


def _verified_key(path: Path, want: Mapping[str, Any]) -> tuple[str, int, int, str] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, str(want.get(HASH_KEY)))


def verified(path: Path, want: Mapping[str, Any]) -> bool:
    """Whether this process has verified `path` against `want` already (and it is unchanged)."""
    return _verified_key(path, want) in _verified


def verify_files(root: Path, files: Mapping[str, Mapping[str, Any]], what: str, once: bool = False) -> int:
    """Every listed file present with its recorded size and hash; returns the bytes hashed.
    `once`: skip a file this process has verified already (same path, size, mtime and hash),
    so that stores opened by every stage of a pipeline are hashed once."""
    hashed = 0
    for name, want in sorted(files.items()):
        path = root / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing from the {what} (its header lists it)")
        st = path.stat()
        key = _verified_key(path, want)
        if once and key in _verified:
            continue
        if st.st_size != want.get("bytes"):
            raise ArtifactError(
                f"{path}: {st.st_size} bytes, the {what}' header records {want.get('bytes')}: truncated or replaced"
            )
        got = file_hash(path)
        hashed += st.st_size
        if got != want.get(HASH_KEY):
            raise ArtifactError(
                f"{path}: content changed (XXH3-64 {got}, the {what}' header records {want.get(HASH_KEY)})"
            )
        _verified.add(key)
    return hashed


# -- reading and writing -------------------------------------------------------------------


def header_file(path: str | os.PathLike) -> Path | None:
    """The file holding `path`'s header: `path` itself (a JSON file), or a directory's metadata
    file; None where there is none."""
    p = Path(path)
    if p.is_file():
        return p
    for name in METADATA_FILES:
        if (p / name).is_file():
            return p / name
    return None


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def load_metadata(path: str | os.PathLike) -> Any:
    """The JSON document of a metadata file of ours (`METADATA_FILES`); one that cannot be
    parsed (cut short by a copy, a full disk, a hand edit) is an `ArtifactError` naming it, not
    an artifact "made before headers": read as that, it would skip every check before reading."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(
            f"{p}: damaged metadata, not valid JSON ({e}); restore it or make the artifact again"
        ) from None


def read(path: str | os.PathLike) -> Header | None:
    """`path`'s header; None for an artifact without one (foreign, or made before headers).
    A metadata file of ours (`METADATA_FILES`) that is not valid JSON is refused
    (`load_metadata`). A header that lists no files takes those of the document holding it (a
    checkpoint's `files`)."""
    held = header_file(path)
    if held is None:
        return None
    doc = load_metadata(held) if held.name in METADATA_FILES else _load(held)
    if not isinstance(doc, dict) or not isinstance(doc.get(HEADER_KEY), dict):
        return None
    header = Header.from_json(doc[HEADER_KEY], str(held))
    if not header.files and isinstance(doc.get("files"), dict):
        header.files = doc["files"]
    return header


def embed(doc: Mapping[str, Any], header: Header) -> dict[str, Any]:
    """`doc` with `header` under `artifact` (its `content`: the hash of `doc`): what an owner of
    a metadata format writes."""
    body = {k: v for k, v in doc.items() if k != HEADER_KEY}
    header.stamp()
    header.content = content_hash(body)
    return {**body, HEADER_KEY: header.to_json()}


def check_content(path: str | os.PathLike, what: str) -> None:
    """The metadata file holding a header is as written: its body hashes to the header's
    `content` (skipped for a header without one)."""
    held = header_file(path)
    doc = _load(held) if held is not None else None
    if not isinstance(doc, dict) or not isinstance(doc.get(HEADER_KEY), dict):
        return
    want = doc[HEADER_KEY].get("content")
    got = content_hash({k: v for k, v in doc.items() if k != HEADER_KEY})
    if want is not None and got != want:
        raise ArtifactError(f"{held}: edited since it was written ({what}; content {got}, its header records {want})")


def write(path: str | os.PathLike, header: Header, doc: Mapping[str, Any] | None = None) -> Path:
    """Write `doc` (or nothing but the header) with `header` embedded, atomically. `path`: the
    metadata file, or a directory (then its `artifact.json`)."""
    p = Path(path)
    target = p / HEADER_FILE if p.is_dir() else p
    atomic_write_text(target, json.dumps(embed(doc or {}, header), indent=1, default=str) + "\n")
    return target


def require(
    path: str | os.PathLike,
    kind: str | tuple[str, ...],
    finished: bool = True,
    what: str | None = None,
    fingerprint: str | None = None,
    legacy_ok: bool = True,
) -> Header | None:
    """`path`'s header, checked to be of `kind`, finished (unless `finished` is False) and,
    given `fingerprint`, made from that. An artifact without a header is returned as None when
    `legacy_ok` (made before headers: not checked), else refused."""
    kinds = (kind,) if isinstance(kind, str) else kind
    name = what or kinds[0].replace("_", " ")
    header = read(path)
    if header is None:
        if legacy_ok and Path(path).exists():
            return None
        raise ArtifactError(f"{path}: not a {name} (no artifact header found)")
    if header.kind not in kinds:
        raise ArtifactError(f"{path}: holds a {header.kind.replace('_', ' ')}, expected a {name}")
    if finished and header.status != "finished":
        raise ArtifactError(f"{path}: the {name} did not finish ({header.describe()})")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise ArtifactError(
            f"{path}: the {name} has fingerprint {header.fingerprint}, expected {fingerprint} (made from other inputs)"
        )
    return header


# -- deleting only our own -----------------------------------------------------------------


def own_kind(path: Path, kind: str) -> bool:
    """Whether `path` is absent, an empty directory, or an artifact of `kind` by its header."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return True
    header = read(path) if not path.is_symlink() else None
    return header is not None and header.kind == kind


def check_replaceable(path: str | os.PathLike, kind: str, command: str) -> None:
    """Refuse, before any work, to replace `path` unless it is `command`'s own kind of output."""
    p = Path(path)
    if not own_kind(p, kind):
        header = read(p) if p.exists() else None
        held = f"a {header.kind.replace('_', ' ')}" if header else "files that are not a " + kind.replace("_", " ")
        raise ArtifactError(
            f"{p}: exists and holds {held}; `{command}` replaces only its own output: choose another path"
        )


def check_output_dir(path: str | os.PathLike, kind: str, what: str, writes: Callable[[str], bool]) -> None:
    """`path` may take a `kind` output written into it (a sweep's tables, a pipeline root's
    report): it is absent, an artifact of `kind`, or holds nothing of the names it writes
    (`writes`) but its lock and temp files. An artifact of another kind, or a file or folder of
    another's where it writes one (a `report.md`, a `losses.csv`), is one line before anything
    is written there (docs/design.md section 6b); other files beside are left alone."""
    p = Path(path)
    if not p.is_dir():
        return
    header = read(p)
    if header is not None:
        if header.kind != kind:
            raise ArtifactError(
                f"{p}: holds a {header.kind.replace('_', ' ')}, not a {kind}; give {what} a new or empty directory"
            )
        return
    taken = sorted(e.name for e in p.iterdir() if writes(e.name) and e.name != ".lock" and not e.name.endswith(".tmp"))
    if taken:
        names = ", ".join(repr(n) for n in taken[:3]) + (" ..." if len(taken) > 3 else "")
        raise ArtifactError(
            f"{p}: holds {names}, not written by a {kind} (no header); give {what} a new or empty directory"
        )


def remove_own(path: str | os.PathLike, kind: str, command: str) -> None:
    """Remove `path` (a directory or file) only if it is an artifact of `kind`."""
    p = Path(path)
    check_replaceable(p, kind, command)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def replace_dir(staging: Path, out: Path, kind: str, command: str) -> None:
    """Rename the finished `staging` directory to `out`; an `out` already there is replaced only
    if it is `command`'s own kind of output (moved out of view first, then removed)."""
    check_replaceable(out, kind, command)
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old.tmp")
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


def set_aside(path: Path, label: str = "incomplete", now: float | None = None) -> Path:
    """Move `path` to `PATH.<label>-YYYYmmdd-HHMMSS` (with `-N` when taken), never deleting it:
    what the tool did not make (a checkpoint copied without its meta.json) is kept."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    dest, n = path.with_name(f"{path.name}.{label}-{stamp}"), 1
    while dest.exists():
        dest, n = path.with_name(f"{path.name}.{label}-{stamp}-{n}"), n + 1
    path.rename(dest)
    return dest
