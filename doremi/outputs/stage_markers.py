"""The files that say a pipeline stage started and finished: named, written and read here only.

A stage's output is a directory (a run) or a file (a round's weights JSON, or a main run's
`eval.json`, an output that exists only as its marker's result). Its marker, `DIR/stage.json`
or `FILE.stage.json`, holds `stage`, `fingerprint` (of the config that made the output),
`keys` (the config keys hashed) and `result`, and is written when the stage completes; while
it runs, `stage.started.json` / `FILE.stage.started.json` holds the fingerprint, so that a stage
interrupted under another config is redone from scratch rather than resumed.

`kept_path`: where a finished output that a rerun under other keys replaces is kept
(`ROOT/previous/...`, outside the globs of reports and guardrails), with its marker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text

MARKER = "stage.json"

#: A main run's per-domain evaluation: a stage whose output is only its marker's result.
EVAL_OUTPUT = "eval.json"


def dir_marker(directory: Path) -> Path:
    """The marker of a stage whose output is `directory`."""
    return directory / MARKER


def done_marker(out: Path) -> Path:
    """The marker of the stage whose output is `out`: a directory when `out` has no suffix."""
    return dir_marker(out) if out.suffix == "" else out.with_name(out.name + "." + MARKER)


def started_marker(marker: Path) -> Path:
    """`stage.json` -> `stage.started.json`, `eval.json.stage.json` -> `eval.json.stage.started.json`."""
    return marker.with_name(marker.name.removesuffix(".json") + ".started.json")


def read_marker(marker: Path) -> dict[str, Any]:
    return json.loads(marker.read_text())


def write_started(marker: Path, stage: str, fingerprint: str) -> None:
    atomic_write_text(started_marker(marker), json.dumps({"stage": stage, "fingerprint": fingerprint}))


def write_done(
    marker: Path,
    stage: str,
    fingerprint: str,
    result: Any,
    keys: dict[str, Any] | None = None,
    seconds: float | None = None,
) -> None:
    """Mark the stage done (with its `result`) and drop its started marker. `keys`: the config
    keys the fingerprint hashes, so that a rerun under other keys can say which changed.
    `seconds`: the wall-clock time of this run of the stage (a resumed stage: since the resume)."""
    done = {"stage": stage, "fingerprint": fingerprint, "result": result}
    if keys is not None:
        done["keys"] = keys
    if seconds is not None:
        done["seconds"] = seconds
    atomic_write_text(marker, json.dumps(done, default=str))
    started_marker(marker).unlink(missing_ok=True)


def eval_result(run: Path) -> dict[str, Any] | None:
    """A main run's evaluation (`domains`, `val_loss`) as the pipeline's eval stage recorded it;
    None before that stage finished."""
    marker = done_marker(run / EVAL_OUTPUT)
    return read_marker(marker)["result"] if marker.is_file() else None


#: The folder of a pipeline root that holds the outputs replaced by reruns under other keys.
PREVIOUS_DIR = "previous"


def kept_path(root: Path, out: Path, fingerprint: str) -> Path:
    """Where the finished output `out` (under `root`) made under `fingerprint` is kept when a
    rerun replaces it: `ROOT/previous/main/doremi.FP`, `ROOT/previous/round1/weights.FP.json`."""
    rel = out.relative_to(root)
    name = f"{out.name}.{fingerprint}" if out.suffix == "" else f"{out.stem}.{fingerprint}{out.suffix}"
    return root / PREVIOUS_DIR / rel.parent / name


def remove_marker_temps(root: Path) -> None:
    """Temp files of stage markers whose atomic write a kill cut short."""
    if root.is_dir():
        for tmp in root.rglob(".*stage*.json.*.tmp"):
            tmp.unlink(missing_ok=True)
