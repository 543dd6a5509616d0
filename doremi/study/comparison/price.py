"""What the comparison costs before any of it runs: GPU-seconds per stage from the study's
measured stage times (docs/design.md section 4f).

Every number a price is made of is `Measured`, with where it was measured; a stage nobody has
timed is priced from a measured one and says how (`Price.how`). The study's times are one
H200's, deterministic kernels, compiled, one stage after another (experiments/results/
doremi_study.md, session 7); its H100 sessions took 223-266 s a main run and 81-95 s a search
run, within about 10% of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """A number and where it was measured (a file and what in it, or an issue)."""

    value: float
    where: str


#: The launch record of the study's seed 4 (`seconds` per stage).
_SEED4 = "experiments/results/doremi_study/study.tar.xz: study/session-7/launch-call2.json (H200)"

#: The study's measured stage times, in seconds.
STAGE_TIMES: dict[str, Measured] = {
    # Tokenising the corpus into stores, once per fresh machine.
    "preprocess": Measured(69.5, f"{_SEED4}, preprocess"),
    # A small run without a method: 13M parameters, 1000 steps x 96 x 1024 tokens.
    "small_run": Measured(76.0, f"{_SEED4}, reference-seed4 (train-reference)"),
    # A small run that reads a reference's forward every step (the DoReMi proxy).
    "reference_proxy": Measured(91.0, f"{_SEED4}, proxy-seed4 (train-proxy)"),
    # Averaging a proxy's logged weights into weights.json.
    "average": Measured(6.0, f"{_SEED4}, proxy-seed4 (average)"),
    # A main run: 53M parameters, 4400 steps x 32 x 1024 tokens.
    "main_run": Measured(240.0, f"{_SEED4}, uniform-seed4 (train)"),
}

#: Device seconds a session may spend (30 device-minutes; experiments/results/doremi_study.md).
SESSION_SECONDS = 30 * 60


@dataclass(frozen=True)
class Price:
    """A stage's estimated GPU-seconds and how they were estimated."""

    seconds: float
    how: str


def run_price(
    base: str,
    multiple: float = 1.0,
    step_ratio: Measured | None = None,
    validation_share: float = 0.0,
    runs: int = 1,
    times: dict[str, Measured] | None = None,
) -> Price:
    """`runs` runs of the measured stage `base`, `multiple` times as many steps, each step
    `step_ratio` as fast as a plain one (a method measured against plain training), plus
    validation passes of `validation_share` of the training FLOPs timed at the training's FLOP
    rate (an estimate: a pass is a forward only)."""
    t = (times or STAGE_TIMES)[base]
    ratio = 1.0 if step_ratio is None else step_ratio.value
    seconds = runs * t.value * multiple / ratio * (1.0 + validation_share)
    parts = [f"{t.value:g} s ({base})"]
    if runs != 1:
        parts.insert(0, f"{runs} x")
    if multiple != 1:
        parts.append(f"x {multiple:g} steps")
    if step_ratio is not None:
        parts.append(f"/ {step_ratio.value:g} (step ratio: {step_ratio.where})")
    if validation_share:
        parts.append(f"x (1 + {validation_share:g} validation)")
    return Price(seconds, " ".join(parts))


def sessions(total_seconds: float, overhead: Measured | None = None, per_session: int = SESSION_SECONDS) -> int:
    """Sessions of `per_session` device-seconds that `total_seconds` of stages need when each
    session first spends `overhead` (preprocessing on a fresh machine). A lower bound: stages do
    not split at session ends (a stopped run resumes from its last checkpoint, repeating the
    steps since it) and the machine's own start is not counted."""
    o = (overhead or STAGE_TIMES["preprocess"]).value
    return math.ceil(total_seconds / (per_session - o)) if total_seconds > 0 else 0
