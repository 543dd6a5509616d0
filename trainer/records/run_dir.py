"""A run directory's identity and ownership.

- Identity: the config keys that determine a run's results (model, data, mixture, method,
  optimizer, schedule, seeds), flattened to `section.key` paths, and their fingerprint. Each
  checkpoint records them, so that a resume under a changed config is caught before it trains
  on from weights that the new config would never have produced.
- Resume policy: what a job may do with a directory that already holds checkpoints.
- Ownership: an advisory `fcntl.flock` on `LOCK_FILE`, held for the job's life. The OS releases
  it when the holder dies, so a killed job leaves no stale lock.
- Status: `run.json` carries the run's artifact header (`data.artifact`; docs/design.md
  section 6b): `running` from the start, `finished` at step N of N, `interrupted` at a signal; a
  killed run stays `running` with its lock free. `require_finished` is what a consumer (a proxy
  of its reference, `doremi average` of its proxy) asks before it reads a run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from data import artifact
from data.errors import UserError
from trainer.config.tools import ConfigError, to_dict

LOCK_FILE = ".lock"
RECORD_FILE = "run.json"

#: Keys (or whole sections) that change how a run computes, not what: logging, checkpoint
#: cadence, eval, where things are written, the parallel layout and precision (checkpoints load
#: into another layout and precision by design), and accumulation (the same global batch).
NOT_RESULT_KEYS = (
    "logging",
    "pipeline",
    "parallelism",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.resume",
    "checkpoint.resume_changed",
    "checkpoint.start_over",
    "train.run_dir",
    "train.extend",
    "train.eval_every",
    "train.eval_sequences",
    "train.eval_sequence_losses",
    "train.device",
    "train.precision",
    "train.deterministic",
    "train.param_dtype",
    "train.micro_batches",
    "model.attention",
    "model.compile",
    "data.store_dir",
    "data.num_proc",
)

#: Keys whose value may name a file or run directory: its content is part of the identity.
PATH_KEYS = ("data.domain_weights",)


def flatten_keys(raw: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted key paths -> leaf values (`train.lr` -> 0.001): what
    fingerprints and their differences are computed over."""
    if isinstance(raw, dict) and raw:
        out: dict[str, Any] = {}
        for k, v in raw.items():
            out.update(flatten_keys(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: raw}


def record_keys(cfg: Any) -> dict[str, Any]:
    """`cfg` flattened (`flatten_keys`), each section its class moved (`MOVED`: old section ->
    its path now) named by its old path, so that a run recorded before the move keeps its
    fingerprint and its keys."""
    flat = flatten_keys(to_dict(cfg))
    for old, new in getattr(cfg, "MOVED", {}).items():
        flat = {old + k[len(new) :] if k == new or k.startswith(new + ".") else k: v for k, v in flat.items()}
    return flat


def path_keys(cfg: Any) -> tuple[str, ...]:
    """`PATH_KEYS` and those the config class adds (`RECORD_PATH_KEYS`, by their record path)."""
    return (*PATH_KEYS, *getattr(cfg, "RECORD_PATH_KEYS", ()))


def _excluded(key: str, ignore: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in (*NOT_RESULT_KEYS, *ignore))


def schedule_depends_on_steps(train: Any) -> bool:
    """Whether `train.steps` changes the learning rate of earlier steps (decay or warmup
    fraction): only then is a resume with more steps a different run."""
    warmup_scales = train.warmup_steps is None and train.warmup_fraction > 0
    return train.decay != "constant" or warmup_scales


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()[:16]


def content_id(value: Any) -> str | None:
    """What a path-valued key points at: a file's content, a run directory's recorded
    fingerprint and newest checkpoint, a cache's metadata. None when it names nothing."""
    if not isinstance(value, str):
        return None
    p = Path(value)
    if p.is_file():
        return _digest(p.read_bytes())
    if (p / RECORD_FILE).is_file():
        from trainer.checkpoint.checkpoint import latest_checkpoint

        latest = latest_checkpoint(p)
        record = json.loads((p / RECORD_FILE).read_text()).get("fingerprint")
        return f"{record}@{latest.name if latest else None}"
    if (p / "meta.json").is_file():
        return _digest((p / "meta.json").read_bytes())
    return None


def result_keys(cfg: Any, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """The flattened config keys that determine the run's results (`ignore`: sections or keys
    the caller does not use, e.g. `doremi` for a plain training run), with `KEY (content)`
    entries for what path-valued keys point at."""
    ignore = (*ignore, *getattr(cfg, "RECORD_IGNORES", ()))
    keys = {k: v for k, v in record_keys(cfg).items() if not _excluded(k, ignore)}
    train = getattr(cfg, "train", None)
    if train is not None and not schedule_depends_on_steps(train):
        keys.pop("train.steps", None)
    for k in path_keys(cfg):
        if k in keys:
            cid = content_id(keys[k])
            if cid is not None:
                keys[f"{k} (content)"] = cid
    return keys


def fingerprint(keys: dict[str, Any]) -> str:
    return _digest(json.dumps(keys, sort_keys=True, default=str))


def record(cfg: Any, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """What a run directory and each of its checkpoints remember of the config."""
    keys = result_keys(cfg, ignore)
    return {"fingerprint": fingerprint(keys), "keys": keys}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def changed_keys(old: dict[str, Any], new: dict[str, Any], limit: int = 4) -> str:
    """`a.b 1.0 -> 3.0, c.d x -> y` for the keys that differ ('(unset)' for a missing one)."""
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k, "(unset)") != new.get(k, "(unset)")]
    parts = [f"{k} {_short(old.get(k, '(unset)'))} -> {_short(new.get(k, '(unset)'))}" for k in diff[:limit]]
    if len(diff) > limit:
        parts.append(f"and {len(diff) - limit} more")
    return ", ".join(parts)


# -- resume policy (pure) ------------------------------------------------------------------


def check_resume(
    run_dir: str | os.PathLike,
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    saved_step: int,
    steps: int,
    allow_changed: bool,
) -> None:
    """Refuse a resume that would train under another config than the checkpoint's, or that
    has nothing left to do because `train.steps` is below the checkpoint's step. `saved` is
    None for a checkpoint written before fingerprints were recorded."""
    if saved_step > steps:
        raise ConfigError(
            f"{run_dir}: train.steps={steps} is below the step of the checkpoint to resume "
            f"({saved_step}); set train.steps >= {saved_step}, or start a new run directory"
        )
    if saved is None or allow_changed or saved.get("fingerprint") == current["fingerprint"]:
        return
    raise ConfigError(
        f"{run_dir}: resuming under a changed config: "
        f"{changed_keys(saved.get('keys', {}), current['keys'])}; start a new run directory, "
        f"or set checkpoint.resume_changed: true to continue anyway"
    )


def without(rec: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A record less `keys`, its fingerprint recomputed: what two runs must still share when a
    resume deliberately changes those keys (train.steps, for `train.extend`)."""
    kept = {k: v for k, v in rec.get("keys", {}).items() if k not in keys}
    return {**rec, "keys": kept, "fingerprint": fingerprint(kept)}


def sources(cfg: Any) -> list[artifact.Source]:
    """What a run is made from: its stores (by the manifest's fingerprint) and what its
    path-valued keys name (`content_id`)."""
    from data.store.store import MANIFEST_FILE

    out = []
    store_dir = getattr(getattr(cfg, "data", None), "store_dir", None)
    manifest = Path(store_dir or "") / MANIFEST_FILE
    if store_dir and manifest.is_file():
        out.append(artifact.Source("stores", str(store_dir), json.loads(manifest.read_text()).get("fingerprint")))
    flat = record_keys(cfg)
    for k in path_keys(cfg):
        value = flat.get(k)
        if isinstance(value, str) and (cid := content_id(value)) is not None:
            out.append(artifact.Source(k, value, cid))
    return out


def write_record(
    run_dir: str | os.PathLike,
    rec: dict[str, Any],
    status: str,
    step: int,
    steps: int,
    made_from: list[artifact.Source],
) -> None:
    """`run.json`: the record (`record`, with the stage) and the run's artifact header."""
    header = artifact.Header(
        "run", status=status, fingerprint=rec.get("fingerprint"), step=step, steps=steps, sources=made_from
    )
    before = artifact.read(Path(run_dir) / RECORD_FILE) if (Path(run_dir) / RECORD_FILE).is_file() else None
    if before is not None and before.fingerprint == header.fingerprint:
        header.code = before.code  # a resumed run keeps the code that trained its first steps
    artifact.write(Path(run_dir) / RECORD_FILE, header, rec)


def mark(run_dir: str | os.PathLike, status: str, step: int) -> None:
    """Update the status of `run.json`'s header (no-op without a header)."""
    path = Path(run_dir) / RECORD_FILE
    header = artifact.read(path)
    if header is None:
        return
    header.status, header.step = status, step
    artifact.write(path, header, {k: v for k, v in json.loads(path.read_text()).items() if k != artifact.HEADER_KEY})


def lock_holder(run_dir: str | os.PathLike) -> str | None:
    """The pid of the job that holds `RUN/.lock` (another process), or None when it is free."""
    path = (Path(run_dir) / LOCK_FILE).resolve()
    if path in _held or not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 64).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


def require_finished(
    run_dir: str | os.PathLike, what: str, allow: bool = False, hint: str = ""
) -> artifact.Header | None:
    """The header of a run a consumer reads, refused (one line) while another job trains it, or
    when it did not finish, unless `allow`. None for a run made before headers (not checked)."""
    run = Path(run_dir)
    holder = lock_holder(run)
    if holder is not None:
        raise artifact.ArtifactError(f"{run}: the {what} is still training (pid {holder} holds {run / LOCK_FILE})")
    record = run / RECORD_FILE
    header = artifact.require(record, "run", finished=False, what=f"{what} run") if record.is_file() else None
    if header is not None and header.status == "running":  # killed: its progress is its last checkpoint
        from trainer.checkpoint.checkpoint import latest_checkpoint

        latest = latest_checkpoint(run)
        header.step = int(latest.name.removeprefix("step_")) if latest else 0
    if header is not None and header.status != "finished" and not allow:
        killed = "; killed?" if header.status == "running" else ""
        raise artifact.ArtifactError(f"{run}: the {what} did not finish ({header.describe()}{killed}){hint}")
    return header


def recorded_stage(run_dir: str | os.PathLike) -> str | None:
    """The stage (`train`, `proxy`, `reference`, ...) a run directory's record names; None
    without a record."""
    path = Path(run_dir) / RECORD_FILE
    if not path.is_file():
        return None
    doc = artifact.load_metadata(path)  # damaged: refused, not read as a directory of no stage
    return doc.get("stage") if isinstance(doc, dict) else None


def check_stage(run_dir: str | os.PathLike, stage: str) -> None:
    """A run directory holds one stage's run: a plain training run resuming a proxy's directory
    (or the other way round) would report one model as the other."""
    other = recorded_stage(run_dir)
    if other is not None and other != stage:
        raise ConfigError(
            f"{run_dir}: holds a {other} run, not a {stage} run; give this stage its own "
            f"train.run_dir (or set checkpoint.start_over: true to move the {other} run aside)"
        )


#: What only a run writes: a directory holding one of these is a run's, also one made before
#: `run.json` existed.
RUN_MARKS = (RECORD_FILE, "config.yaml", "checkpoints", "metrics.jsonl")


def _before_a_run(name: str) -> bool:
    """What a run's directory may hold before the run first writes in it: its lock, a pipeline
    stage's markers (`stage.started.json`, doremi/outputs/stage_markers.py) and the temp files
    of atomic writes cut short (`.NAME.XXXX.tmp`, data/atomic.py)."""
    return (
        name == LOCK_FILE
        or (name.startswith("stage.") and name.endswith(".json"))
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def check_owned(run_dir: str | os.PathLike) -> None:
    """`train.run_dir` is new, empty or a run's: a run writes config.yaml, run.json and
    metrics.jsonl into it and removes its temp files, so a directory of another artifact (stores,
    a reference cache, an export) or of files no run wrote is refused before anything is
    written or removed (docs/design.md section 6b, deleting only our own)."""
    p = Path(run_dir)
    if not p.is_dir():
        return
    header = artifact.read(p)
    if header is not None and header.kind != "run":
        raise artifact.ArtifactError(
            f"{p}: holds a {header.kind.replace('_', ' ')}, not a run; give train.run_dir a new or empty directory"
        )
    if any((p / name).exists() for name in RUN_MARKS):
        return
    foreign = sorted(e.name for e in p.iterdir() if not _before_a_run(e.name))
    if foreign:
        raise artifact.ArtifactError(
            f"{p}: holds {', '.join(repr(n) for n in foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
            f"which no run wrote (no {RECORD_FILE} or config.yaml); give train.run_dir a new or empty directory"
        )


def check_fresh_start(run_dir: str | os.PathLike, latest_step: int | None, resume: bool, start_over: bool) -> None:
    """`checkpoint.resume: false` into a directory with checkpoints would have the new run's
    checkpoints pruned in favour of the old, higher steps: refuse unless told to start over."""
    if latest_step is not None and not resume and not start_over:
        raise ConfigError(
            f"{run_dir}: checkpoint.resume is false but the run directory holds checkpoints "
            f"up to step {latest_step}; set checkpoint.start_over: true to move them aside and "
            f"start again, or use another run directory"
        )


def check_incomplete(run_dir: str | os.PathLike) -> None:
    """Set aside checkpoints without `meta.json` (`trainer.checkpoint.checkpoint.set_aside_incomplete`,
    one line each); when no complete checkpoint remains beside ones set aside, refuse to start
    again from step 0 over the run's metrics (docs/design.md section 6b)."""
    from trainer.checkpoint.checkpoint import latest_checkpoint, set_aside_found, set_aside_incomplete

    set_aside_incomplete(run_dir)
    aside = set_aside_found(run_dir)
    if aside and latest_checkpoint(run_dir) is None:
        raise ConfigError(
            f"{run_dir}: no complete checkpoint, only {aside[-1].name} (set aside, no meta.json); "
            f"a new start would overwrite the run's metrics: copy the checkpoint again, use another "
            f"run directory, or set checkpoint.start_over: true to move the run aside"
        )


def aside_path(run_dir: str | os.PathLike, now: float) -> Path:
    """`RUN.old-YYYYmmdd-HHMMSS` (with `-N` when taken): where `start_over` moves a run."""
    p = Path(run_dir)
    base = p.with_name(f"{p.name}.old-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")
    out, n = base, 1
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out


def move_aside(run_dir: str | os.PathLike, now: float | None = None) -> Path | None:
    """Move everything of a run directory but its lock file to `aside_path` (the lock stays
    held by this job). None when there is nothing to move."""
    p = Path(run_dir)
    entries = [e for e in p.iterdir() if e.name != LOCK_FILE] if p.is_dir() else []
    if not entries:
        return None
    dest = aside_path(p, time.time() if now is None else now)
    dest.mkdir(parents=True)
    for e in entries:
        e.rename(dest / e.name)
    return dest


def clear(run_dir: str | os.PathLike) -> None:
    """Remove a run directory's content but its lock file (held by this job)."""
    import shutil

    p = Path(run_dir)
    if not p.is_dir():
        return
    for e in p.iterdir():
        if e.name == LOCK_FILE:
            continue
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e)
        else:
            e.unlink()


# -- the lock ------------------------------------------------------------------------------

_held: dict[Path, list[int]] = {}  # path -> [fd, depth]: one job may take its own lock again


@contextlib.contextmanager
def locked(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold `RUN/.lock` for the block; a second job gets a one-line ConfigError naming the
    directory and the pid written in the lock file. Re-entrant within one process (the
    pipeline holds a stage's directory while its trainer takes it again)."""
    path = (Path(run_dir) / LOCK_FILE).resolve()
    if path in _held:
        _held[path][1] += 1
        try:
            yield
        finally:
            _held[path][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"{run_dir}: run directory in use by another job (pid {holder}, {path}); "
            f"wait for it to finish or use another run directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = [fd, 1]
    try:
        yield
    finally:
        del _held[path]
        os.ftruncate(fd, 0)
        os.close(fd)  # releases the lock


def on_rank0(fn: Callable[[], Any], is_main: bool) -> None:
    """Run `fn` on rank 0 only; an input error it raises (any `UserError`: a config refused, a
    directory of another artifact, damaged metadata) is raised on every rank as a ConfigError,
    so that all ranks stop or none (the others would otherwise wait at the next collective for
    ever)."""
    import torch.distributed as dist

    error = None
    if is_main:
        try:
            fn()
        except UserError as e:
            error = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
