"""Which stages of the comparison's plan wait for which, and how long the plan takes on several
GPUs: the launcher's `--gpus N` (experiments/launch/comparison.py, the study launcher's
`run_on_gpus`) starts each stage on a free GPU as soon as every stage it waits for has ended
well, taking the ready stages longest remaining path first (`start_order`); `wall_seconds`
replays that rule on the stages' prices.

Why the plan needs no more than this: every stage is a separate `doremi` process whose result
does not depend on what else runs (deterministic kernels: a run on one GPU is bitwise the run
alone, ../shared/study-design.md), so the only order that matters is data: a stage reads the
outputs of the stages `waits_for` names."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from doremi.study.comparison.plan import SEARCH, Step


def waits_for(steps: Sequence[Step]) -> list[tuple[int, ...]]:
    """Per step, the earlier steps (indices) whose outputs it may read, conservatively:
    - a step of the same name (its run directory: a proxy's average, a sweep's fits);
    - a pool's inputs (`Step.pool`) and the pool a pooled arm's main run trains on (`Step.reads`);
    - every earlier search step of the same seed that serves one of its arms (a proxy its
      reference, an average its proxy, a fit its sweep, a main run its arm's search).
    A main run never reads another main run, so the main runs of the static arms and the
    equal-compute baselines wait for nothing."""
    out = []
    for i, st in enumerate(steps):
        arms = set(st.arms)
        deps = tuple(
            j
            for j, e in enumerate(steps[:i])
            if e.name == st.name
            or e.name in st.pool
            or (st.reads and e.name == st.reads)
            or (st.seed and e.seed == st.seed and e.role == SEARCH and arms & set(e.arms))
        )
        out.append(deps)
    return out


def remaining_paths(seconds: Sequence[float], waits: Sequence[Sequence[int]]) -> list[float]:
    """Per stage, its seconds plus the longest chain of stages after it that wait for it, directly
    or not: the least time from its start to the plan's end, however many GPUs there are.
    `waits` point backwards (each stage waits only for earlier ones, as `waits_for` gives)."""
    if len(waits) != len(seconds):
        raise ValueError(f"remaining_paths: {len(seconds)} stages but {len(waits)} wait lists")
    paths = [float(x) for x in seconds]
    after = [0.0] * len(seconds)
    for i in reversed(range(len(seconds))):
        paths[i] += after[i]
        for j in waits[i]:
            if not 0 <= j < i:
                raise ValueError(f"remaining_paths: stage {i} waits for stage {j}, not an earlier one")
            after[j] = max(after[j], paths[i])
    return paths


def start_order(seconds: Sequence[float], waits: Sequence[Sequence[int]]) -> list[int]:
    """The order in which the launcher takes ready stages: longest remaining path first
    (`remaining_paths`), plan order among equals. Why not plan order: the plan lists the groups
    one after another (static, transferred, online, equal compute, swept), so the swept arms'
    81-minute sweeps, and the fits and main runs that wait for them, came last and set the wall
    time (140 minutes on 8 GPUs against a floor of 114 for 914 GPU-minutes); started first,
    they run beside the short stages (116). This is the critical-path rule of list scheduling,
    within a factor 2 - 1/N of the best schedule on N GPUs (Graham 1969)."""
    paths = remaining_paths(seconds, waits)
    return sorted(range(len(seconds)), key=lambda i: (-paths[i], i))


def wall_seconds(seconds: Sequence[float], waits: Sequence[Sequence[int]], gpus: int) -> float:
    """The plan's wall time on `gpus` GPUs under the launcher's rule (`run_on_gpus`): whenever a
    GPU is free, the first ready stage (every stage it waits for ended) in `start_order` starts
    on it. Every stage is assumed to take its `seconds` and to end well. One GPU gives the
    stages' sum."""
    if gpus < 1:
        raise ValueError(f"wall_seconds: expected gpus >= 1, got {gpus}")
    if len(waits) != len(seconds):
        raise ValueError(f"wall_seconds: {len(seconds)} stages but {len(waits)} wait lists")
    pending = start_order(seconds, waits)
    ended: set[int] = set()
    running: list[tuple[float, int]] = []
    now = 0.0
    while pending or running:
        started = True
        while started and len(running) < gpus:
            started = False
            for i in pending:
                if all(j in ended for j in waits[i]):
                    heapq.heappush(running, (now + seconds[i], i))
                    pending.remove(i)
                    started = True
                    break
        if not running:
            raise ValueError(f"wall_seconds: stage {pending[0]} waits for a stage that never runs")
        now, i = heapq.heappop(running)
        ended.add(i)
        while running and running[0][0] == now:
            ended.add(heapq.heappop(running)[1])
    return now
