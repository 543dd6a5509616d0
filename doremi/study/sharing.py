"""How much of a GPU each run of a study had, from the launcher's own records (docs/design.md
section 4e, "GPU-seconds of runs that shared the GPU").

The study launcher (experiments/launch/doremi_study.py) may run several main runs side by side
on one GPU; they time-slice it, so each run's training steps take about that many times as
long as they would alone, and the ledger's GPU-seconds (the steps' tokens over their measured
rate, doremi/reports/ledger.py `train_seconds`) would charge every run the whole GPU. Every call
of the launcher records, per stage, `side_by_side` (the runs sharing the GPU) and the wall
`seconds` of its batch, in `launch*.json` under the session's folder of the archive. A run's
share is read from the calls of the session in which it finished (a run cut off in an earlier
session was left out of that session's archive and trained again from its start): the fraction
of its wall time that was its own, sum(seconds_i / k_i) / sum(seconds_i) over those calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from doremi.study.runs import StudyError

TRAINING = ("train", "train-reference", "train-proxy")


def _records(folder: Path) -> list[dict]:
    """The stage records of every launcher call whose record file is in `folder`, in call order."""
    out = []
    for path in sorted(folder.glob("launch*.json"), key=lambda p: (len(p.name), p.name)):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("stages", []), list):
            raise StudyError(
                f"{path}: damaged launcher record (expected a JSON object with a `stages` list); the GPU "
                f"shares of its runs cannot be read"
            )
        out += [s for s in doc.get("stages", []) if isinstance(s, dict) and s.get("command") in TRAINING]
    return out


def _natural(path: Path) -> list:
    """`session-2` before `session-10`: the launcher's session labels are counted."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def device_shares(root: str | Path) -> dict[str, float]:
    """Run name -> the fraction of a GPU it had while it trained, for the runs that shared one
    (every other run had it whole). Read from the launcher's records under `root` (an unpacked
    study or calibration archive); a run finished in several sessions (trained again) is the
    last session's, sessions ordered by their labels' numbers."""
    folders = sorted({p.parent for p in Path(root).rglob("launch*.json")}, key=_natural)
    shares: dict[str, float] = {}
    for folder in folders:
        records = _records(folder)
        finished = {r["stage"] for r in records if r.get("exit_status") == 0 and "seconds" in r}
        for name in finished:
            calls = [r for r in records if r["stage"] == name and isinstance(r.get("seconds"), (int, float))]
            wall = sum(float(r["seconds"]) for r in calls)
            own = sum(float(r["seconds"]) / max(int(r.get("side_by_side") or 1), 1) for r in calls)
            shares[name] = own / wall if wall > 0 else 1.0
    return {name: share for name, share in shares.items() if share < 1.0}


def shares_of(runs: Iterable[Path]) -> dict[str, float]:
    """`device_shares` of the folders holding `runs` (their launcher records lie beside them,
    in the session folders of the archive each came from), merged."""
    out: dict[str, float] = {}
    for folder in sorted({Path(r).parent for r in runs}):
        out.update(device_shares(folder))
    return out
