"""The whole trainer under (tp, pp, dp) layouts equals one process (docs/design.md sections 4, 5, 8).

Every layout trains the same tiny Llama on the same global batch for three steps; per-step
losses and the parameters after the last step (read back from the sharded checkpoint into one
process) must match the single-process run within 1e-5. The DoReMi proxy's alpha_t must agree
within 1e-6 across layouts and micro-batching. A checkpoint written at (2, 2, 2) must resume at
other layouts and continue exactly as the single-process run does. Runs are grouped by world
size so that each group costs one spawn of gloo processes.

Layouts run (tp, pp, dp / options; global batch 8, 1 or 4 micro-batches unless stated):
  world 2: (2,1,1) plain; (2,1,1) seq-parallel + async + recomputed all-gather + selective, 4 mb;
           (1,2,1) 1F1B + full recompute, 4 mb; (1,2,1) AFAB, 4 mb; (1,1,2) ZeRO-1;
           (1,1,2) no ZeRO, 4 mb; resumes of the (2,2,2) checkpoint at (1,1,2), (2,1,1), (1,2,1)
  world 4: (2,2,1) seq-parallel, 1F1B, 4 mb; (2,1,2) seq-parallel + ZeRO-1;
           (1,2,2) AFAB + ZeRO-1, 4 mb; (1,4,1) 1F1B, 8 mb
  world 8: (2,2,2) seq-parallel + async + recomputed all-gather + selective + ZeRO-1, 2 mb
DoReMi proxy (alpha_t, steps 1..5): 1 process with 1 and 4 mb; dp2; tp2; pp2; tp2 pp2 dp2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from doremi.pipeline import stages
from tests.compare_runs import COMPARED, assert_same_alphas, assert_same_params
from tests.distributed import spawn, world_size
from tests.runs import alphas, config, final_params, losses, run_stage, single_process_runs, val_losses

LAYOUTS: dict[str, list[str]] = {
    "tp2": ["parallelism.tp=2"],
    "tp2-sp-async-rag-sel-mb4": [
        "parallelism.tp=2",
        "parallelism.sequence_parallel=true",
        "parallelism.tp_async=true",
        "parallelism.tp_recompute_allgather=true",
        "parallelism.recompute=selective",
        "train.micro_batches=4",
    ],
    "pp2-1f1b-full-mb4": [
        "parallelism.pp=2",
        "parallelism.pp_schedule=1f1b",
        "parallelism.recompute=full",
        "train.micro_batches=4",
    ],
    "pp2-afab-mb4": ["parallelism.pp=2", "parallelism.pp_schedule=afab", "train.micro_batches=4"],
    "dp2-zero1": ["parallelism.dp=2", "parallelism.zero1=true"],
    "dp2-nozero-mb4": ["parallelism.dp=2", "parallelism.zero1=false", "train.micro_batches=4"],
    "tp2-pp2-sp-mb4": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.sequence_parallel=true",
        "train.micro_batches=4",
    ],
    "tp2-dp2-sp-zero1": ["parallelism.tp=2", "parallelism.dp=2", "parallelism.sequence_parallel=true"],
    "pp2-dp2-afab-zero1-mb4": [
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.pp_schedule=afab",
        "train.micro_batches=4",
    ],
    "pp4-1f1b-mb8": ["parallelism.pp=4", "train.micro_batches=8"],
    "tp2-pp2-dp2-all": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.sequence_parallel=true",
        "parallelism.tp_async=true",
        "parallelism.tp_recompute_allgather=true",
        "parallelism.recompute=selective",
        "train.micro_batches=2",
    ],
}
#: The world-2 layouts, one per kind of sharding: the proxy trains at each, and the (2,2,2)
#: checkpoint resumes at each.
WORLD2: dict[str, list[str]] = {
    "dp2": ["parallelism.dp=2"],
    "tp2": ["parallelism.tp=2"],
    "pp2": ["parallelism.pp=2", "train.micro_batches=2"],
}
PROXY_LAYOUTS: dict[str, list[str]] = {
    **{f"proxy-{name}": sets for name, sets in WORLD2.items()},
    "proxy-tp2-pp2-dp2": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.sequence_parallel=true",
        "train.micro_batches=2",
    ],
}
RESUME_AT: dict[str, list[str]] = {f"resume-{name}": sets for name, sets in WORLD2.items()}


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    proxy = single_process_runs(stores, root, COMPARED, ["train.steps=5"])
    stages.train_proxy(config(stores, root / "proxy-single-mb4", *proxy, "train.micro_batches=4"))

    jobs: dict[int, dict[str, list]] = {2: {}, 4: {}, 8: {}}
    for name, sets in LAYOUTS.items():
        jobs[world_size(sets)].setdefault("train", []).append((str(root / name), [*COMPARED, *sets]))
    for name, sets in PROXY_LAYOUTS.items():
        jobs[world_size(sets)].setdefault("train-proxy", []).append((str(root / name), [*proxy, *sets]))
    ckpt = root / "ckpt-222"
    jobs[8]["train"].append((str(ckpt), [*COMPARED, "train.steps=2", *LAYOUTS["tp2-pp2-dp2-all"]]))
    for size in (8, 4):
        for stage, stage_jobs in jobs[size].items():
            spawn(run_stage, size, stage, str(stores), stage_jobs)
    for name, sets in RESUME_AT.items():
        shutil.copytree(ckpt, root / name)
        jobs[2].setdefault("train", []).append((str(root / name), [*COMPARED, "train.steps=4", *sets]))
    for stage, stage_jobs in jobs[2].items():
        spawn(run_stage, 2, stage, str(stores), stage_jobs)
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, stores, name):
    assert len(losses(runs / name)) == 3
    assert losses(runs / name) == pytest.approx(losses(runs / "single"), rel=1e-5)
    assert val_losses(runs / name) == pytest.approx(val_losses(runs / "single"), rel=1e-5)
    want, got = final_params(stores, runs / "single"), final_params(stores, runs / name)
    assert_same_params(got, want)


@pytest.mark.parametrize("name", list(RESUME_AT))
def test_checkpoint_222_resumes_at_other_layouts(runs, stores, name):
    whole = losses(runs / "single-4steps")
    assert losses(runs / name) == pytest.approx(whole, rel=1e-5)  # steps 1-2 from (2,2,2), 3-4 here
    want, got = final_params(stores, runs / "single-4steps"), final_params(stores, runs / name)
    assert_same_params(got, want)


@pytest.mark.parametrize("name", ["proxy-single-mb4", *PROXY_LAYOUTS])
def test_doremi_weights_do_not_depend_on_layout(runs, name):
    assert_same_alphas(alphas(runs / "proxy-single"), alphas(runs / name), 5, moved=1e-3)
