"""The GPU bench scripts import on a CPU machine, and every ablation names attributes that exist
(a rename in the model would otherwise only show on the GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"


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

