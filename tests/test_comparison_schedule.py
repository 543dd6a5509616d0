"""The comparison on several GPUs: which stages wait for which (doremi/study/comparison/schedule.py),
the plan's wall time under the launcher's rule, and the study launcher's `run_on_gpus` running
real processes by that rule (each on its own CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

from doremi.study.comparison import plan as planning
from doremi.study.comparison.protocol import PROTOCOL, pairs_from_calibration
from doremi.study.comparison.schedule import remaining_paths, start_order, waits_for, wall_seconds
from doremi.study.runs import seeds_for

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "experiments" / "results" / "doremi_study" / "calibration.json"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def steps():
    return planning.plan(PROTOCOL, seeds_for(pairs_from_calibration(str(CALIBRATION)).pairs))


def test_each_stage_waits_for_exactly_the_stages_whose_outputs_it_reads(steps):
    waits = waits_for(steps)
    at = {(s.name, s.verb): i for i, s in enumerate(steps)}
    names = lambda i: sorted(f"{steps[j].name}/{steps[j].verb}" for j in waits[i])  # noqa: E731
    assert all(j < i for i, w in enumerate(waits) for j in w)
    assert names(at["unimax-seed2", "train"]) == names(at["uniform_x2-seed1", "train"]) == []
    assert names(at["odm_online-seed3", "train"]) == []
    assert names(at["doge-seed1", "train"]) == ["doge_pooled/average", "doge_proxy-seed1/train-proxy"]
    assert names(at["doge_pooled", "average"]) == [f"doge_proxy-seed{k}/train-proxy" for k in range(1, 7)]
    assert names(at["proxy-seed2", "average"]) == [
        "proxy-seed2/train-proxy",
        "reference-seed2/train-reference",
    ]
    assert names(at["regmix_pooled", "fit"]) == [f"sweep-seed{k}/sweep" for k in range(1, 7)]
    assert names(at["mixing_law-seed4", "train"]) == ["mixing_law_pooled/fit", "sweep-seed4/sweep"]
    assert names(at["aioli_proxy-seed5", "train-proxy"]) == []


def test_the_wall_time_follows_the_launchers_rule():
    # 2 GPUs: 0 and 1 start at once; at 5 nothing is ready (2 waits for 0); 2 runs 10..15, 3 15..16
    seconds, waits = [10.0, 5.0, 5.0, 1.0], [(), (), (0,), (1, 2)]
    assert wall_seconds(seconds, waits, 2) == 16.0
    assert wall_seconds(seconds, waits, 1) == 21.0
    assert wall_seconds(seconds, waits, 4) == 16.0
    assert wall_seconds([3.0, 3.0, 3.0], [(), (), ()], 2) == 6.0
    with pytest.raises(ValueError, match="gpus >= 1"):
        wall_seconds(seconds, waits, 0)


def test_the_longest_remaining_path_starts_first():
    # d waits for c, e for d: c's path is 5 + 5 + 2 = 12, d's 7; a and b 1 each. In plan order on
    # 2 GPUs a, b ran 0..1, c 1..6, d 6..11, e 11..13 (13); c first: c 0..5 beside a 0..1 and
    # b 1..2, d 5..10, e 10..12
    seconds, waits = [1.0, 1.0, 5.0, 5.0, 2.0], [(), (), (), (2,), (3,)]
    assert remaining_paths(seconds, waits) == [1.0, 1.0, 12.0, 7.0, 2.0]
    assert start_order(seconds, waits) == [2, 3, 4, 0, 1]
    assert wall_seconds(seconds, waits, 2) == 12.0
    # two branches: the join waits for both, so each path counts the join's 3
    assert remaining_paths([2.0, 4.0, 3.0], [(), (), (0, 1)]) == [5.0, 7.0, 3.0]
    assert start_order([1.0, 1.0], [(), ()]) == [0, 1]
    with pytest.raises(ValueError, match="stage 0 waits for stage 1"):
        remaining_paths([1.0, 1.0], [(1,), ()])


def test_the_plans_wall_time_on_one_gpu_is_its_price_and_falls_with_more(steps):
    seconds = [0.0 if s.reused else s.price.seconds for s in steps]
    waits = waits_for(steps)
    one = wall_seconds(seconds, waits, 1)
    assert one == pytest.approx(planning.total_seconds(steps), rel=1e-12)
    walls = [wall_seconds(seconds, waits, n) for n in (2, 4, 8)]
    assert one > walls[0] > walls[1] > walls[2] >= max(seconds)
    # the longest path first keeps each within 2 % of the bound max(sum / N, longest path)
    longest = max(remaining_paths(seconds, waits))
    for n, wall in zip((2, 4, 8), walls):
        assert wall <= 1.02 * max(one / n, longest)


def test_run_on_gpus_starts_what_is_ready_on_a_free_gpu_and_never_what_waits_for_a_failure(tmp_path):
    """Five stages on 2 GPUs: `b` reads `a`'s output (it fails without it), `d` waits for `c`,
    which fails: `d` is not started, said in its record, while `e`, which waits for nothing, runs.
    Every process sees one GPU of the two and logs apart."""
    launcher = _module("doremi_study_gpus", ROOT / "experiments" / "launch" / "doremi_study.py")
    names = ["a", "b", "c", "d", "e"]
    stages = [launcher.Stage(n, "train", main=True) for n in names]
    write = "import os, pathlib; pathlib.Path(r'{d}/{n}').write_text(os.environ['CUDA_VISIBLE_DEVICES'])"
    code = {
        "a": write.format(d=tmp_path, n="a"),
        "b": f"import pathlib; assert pathlib.Path(r'{tmp_path}/a').is_file(); " + write.format(d=tmp_path, n="b"),
        "c": "raise SystemExit(4)",
        "d": write.format(d=tmp_path, n="d"),
        "e": write.format(d=tmp_path, n="e"),
    }
    cmds = [[sys.executable, "-c", code[n]] for n in names]
    waits = [(), (0,), (), (2,), ()]
    log = tmp_path / "logs" / "launch.log"
    log.parent.mkdir()
    records = {r["stage"]: r for r in launcher.run_on_gpus(stages, cmds, log, None, 2, waits)}
    assert set(records) == set(names)
    assert {n: records[n]["exit_status"] for n in names} == {"a": 0, "b": 0, "c": 4, "d": None, "e": 0}
    assert records["d"]["not_started"] == "waits for c (exit 4)"
    assert {records[n]["gpu"] for n in "abce"} <= {0, 1}
    assert all((tmp_path / n).read_text() == str(records[n]["gpu"]) for n in "abe")
    assert not (tmp_path / "d").exists()
    assert sorted(p.name for p in log.parent.iterdir()) == [f"launch-{n}.log" for n in "abce"]
    with pytest.raises(ValueError, match="2 waits"):
        list(launcher.run_on_gpus(stages, cmds, log, None, 2, waits[:2]))


def test_run_on_gpus_takes_ready_stages_in_the_order_given(tmp_path):
    """On one GPU three independent stages run one at a time in `order`; an order that is not
    every stage's index once is refused."""
    launcher = _module("doremi_study_gpus_order", ROOT / "experiments" / "launch" / "doremi_study.py")
    stages = [launcher.Stage(n, "train", main=True) for n in "abc"]
    cmds = [[sys.executable, "-c", "print('ok')"]] * 3
    records = list(launcher.run_on_gpus(stages, cmds, tmp_path / "l.log", None, 1, [(), (), ()], order=[2, 0, 1]))
    assert [r["stage"] for r in records] == ["c", "a", "b"]
    with pytest.raises(ValueError, match="not every stage's index once"):
        list(launcher.run_on_gpus(stages, cmds, tmp_path / "l.log", None, 1, [(), (), ()], order=[0, 0, 1]))


def test_run_on_gpus_starts_no_stage_that_would_not_end_before_the_deadline(tmp_path, monkeypatch):
    """With 100 s left a 50-s stage starts and a 500-s one does not; what waits for it is not
    started either; the records say both."""
    launcher = _module("doremi_study_gpus_deadline", ROOT / "experiments" / "launch" / "doremi_study.py")
    stages = [launcher.Stage(n, "train", main=True) for n in ("long", "short", "after")]
    cmds = [[sys.executable, "-c", "print('ok')"]] * 3
    now = launcher.time.time()
    records = list(launcher.run_on_gpus(stages, cmds, tmp_path / "l.log", now + 100, 2, [(), (), (0,)], [500, 50, 10]))
    by = {r["stage"]: r for r in records}
    assert by["long"]["not_started"].startswith("needs about 500 s, ")
    assert by["after"]["not_started"] == "waits for long (not started)"
    assert by["short"]["exit_status"] == 0 and "not_started" not in by["short"]


def test_the_comparison_launcher_runs_its_stages_on_several_gpus(tmp_path, monkeypatch):
    """`--gpus 2`: every stage of the plan runs (fake commands), each on GPU 0 or 1, and the
    archive's records say where; `--gpus` with `--side-by-side`, or more GPUs than the machine
    shows, is one line and exit 2."""
    import subprocess

    launcher = _module("comparison_launcher_gpus", ROOT / "experiments" / "launch" / "comparison.py")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}\n")
    monkeypatch.setattr(launcher, "command_of", lambda *a: ["true"])
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 2)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--corpus", str(corpus)]
    assert launcher.main([*argv, "--gpus", "2"]) == 0
    with tarfile.open(tmp_path / "out" / "comparison.tar.xz") as tar:
        info = json.loads(tar.extractfile("comparison/launch.json").read())
    ran = info["stages"][1:]
    assert len(ran) == len([s for s in planning.plan(PROTOCOL, seeds_for(6)) if not s.reused])
    assert {r["gpu"] for r in ran} == {0, 1} and all(r["exit_status"] == 0 for r in ran)
    for bad in (["--gpus", "2", "--side-by-side", "2"], ["--gpus", "3"]):
        with pytest.raises(SystemExit) as e:
            launcher.main([*argv, *bad])
        assert e.value.code == 2


def test_run_on_gpus_stops_what_runs_at_the_deadline_and_starts_nothing_after_it(tmp_path, monkeypatch):
    """At the deadline both running stages get SIGTERM (each would run until signalled) and
    their records say stopped; the stage waiting for one of them never starts; past the
    deadline nothing starts at all."""
    import types

    launcher = _module("doremi_study_gpus_stop", ROOT / "experiments" / "launch" / "doremi_study.py")
    clock = {"now": 0.0}

    def now() -> float:
        clock["now"] += 1.0
        return clock["now"]

    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(time=now, sleep=lambda s: None))
    stages = [launcher.Stage(n, "train", main=True) for n in ("a", "b", "c")]
    blocked = "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); signal.pause()"
    cmds = [[sys.executable, "-c", blocked]] * 2 + [[sys.executable, "-c", "print('never')"]]
    records = list(launcher.run_on_gpus(stages, cmds, tmp_path / "l.log", 5.0, 2, [(), (), (0,)]))
    assert sorted(r["stage"] for r in records) == ["a", "b"]
    assert all(r["stopped"] and r["exit_status"] not in (0, None) for r in records), records
    assert list(launcher.run_on_gpus(stages, cmds, tmp_path / "l.log", 0.0, 2, [(), (), (0,)])) == []
