"""The GPU bench scripts import on a CPU machine, and every ablation names attributes that exist
(a rename in the model would otherwise only show on the GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "tools" / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in ("step_bench", "profile_step", "micro_bench")}
    finally:
        sys.path.remove(str(BENCH))


def test_ablations_patch_existing_attributes(bench_modules):
    ablations = bench_modules["step_bench"].ABLATIONS
    labels = [label for label, _, _ in ablations]
    assert len(set(labels)) == len(labels)
    for label, overrides, patches in ablations:
        for (obj, attr), value in patches.items():
            current = getattr(obj, attr)
            assert type(current) is type(value) or callable(current) and callable(value), (label, attr)



def test_paired_windows_alternate_abba_and_rows_compare_within_their_group(bench_modules, monkeypatch):
    sb = bench_modules["step_bench"]
    monkeypatch.setattr(sb.torch.cuda, "synchronize", lambda: None)
    calls: list[str] = []
    seen = sb.paired_windows({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, iters=2, rounds=2)
    assert "".join(calls) == "aabbbbaaaabbbbaa"
    assert [len(v) for v in seen.values()] == [4, 4]
    rows = [sb.Row("1b", "baseline --compile", 100.0), sb.Row("1b", "plain", 104.0),
            sb.Row("1b", "baseline --compile", 100.0, group="paired"), sb.Row("1b", "plain", 106.0, group="paired")]
    table = sb.format_table(rows).splitlines()
    assert "1.040" in table[2] and "plain (paired)" in table[4] and "1.060" in table[4]
