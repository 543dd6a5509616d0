"""`doremi plan` on a small model reads at a glance (issue 43 item 3): sizes in units that fit the
model (K parameters and MiB, not `0.00B`), a unit on every column header, and layouts that the
plan cannot tell apart shown as one line with their ties named under it."""

from __future__ import annotations

import re

import pytest

from doremi.commands.cli import main, tied_groups
from tests.paths import QUICKSTART

LAYOUT = re.compile(r"^  #(\d+) (.+?): peak (.+?), predicted step (.+?)  \(")


def test_tied_groups_keep_the_first_of_each_key_in_order():
    items = ["a1", "b1", "a2", "c1", "b2", "a3"]
    assert tied_groups(items, lambda s: s[0]) == [["a1", "a2", "a3"], ["b1", "b2"], ["c1"]]
    assert tied_groups([], lambda s: s) == []


def test_plan_of_the_quickstart_has_units_and_collapses_ties(capsys):
    assert main(["plan", str(QUICKSTART), "--gpus", "8", "--gpu-memory", "80"]) in (0, None)
    out = capsys.readouterr().out
    assert "0.00B" not in out and "698K" in out  # the reference's parameters, in thousands
    headers = [i for i, line in enumerate(out.splitlines()) if line.startswith("stage   layers")]
    assert headers and all(out.splitlines()[i - 1] == "memory per rank of each stage, in MiB:" for i in headers)
    assert "peak 12.0 MiB on stage 0" in out
    sections = out.split("\nlayouts of ")[1:]  # one per group of stages that share a model
    assert len(sections) == 2  # reference and proxy; the main runs
    for section in sections:
        lines = section.splitlines()
        shown = [LAYOUT.match(line) for line in lines if line.startswith("  #")]
        assert shown and all(shown)
        assert [int(m.group(1)) for m in shown] == list(range(1, len(shown) + 1))
        keys = [(m.group(3), m.group(4)) for m in shown]
        assert len(set(keys)) == len(keys)  # no two lines the plan cannot tell apart
        assert all(re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", peak) for peak, _ in keys)
        assert all(re.fullmatch(r"[\d.]+ (us|ms|s)", step) for _, step in keys)
        ties = [i for i, line in enumerate(lines) if line.startswith("     tied with it (")]
        assert ties  # the quickstart's small stages: recompute none and selective cost the same
        for i in ties:
            first = LAYOUT.match(lines[i - 1])
            count = int(lines[i].split("(")[1].split(")")[0])
            named = lines[i].split("): ", 1)[1].split("; ")
            assert first and len(named) == count and first.group(2) not in named


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--gpus", "0", "--gpu-memory", "80"], "--gpus: expected a positive number of GPUs, got 0"),
        (["--gpus", "8", "--gpu-memory", "nan"], "--gpu-memory: expected a positive number of GiB, got nan"),
        (["--gpus", "8", "--gpu-memory", "80", "--top", "-1"], "--top: expected >= 0, got -1"),
    ],
)
def test_plan_refuses_impossible_arguments_with_one_line(capsys, args, needle):
    """`--gpus 0` printed "cannot run on 0 GPUs" per stage and `--gpu-memory nan` a plan of
    "usable nan GiB", both with exit status 0."""
    assert main(["plan", str(QUICKSTART), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"doremi plan: error: {needle}"] and captured.out == ""
