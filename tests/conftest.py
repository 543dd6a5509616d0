"""Shared fixtures, and which test files are slow (SLOW): `make test-fast` leaves them out, and
`make test` starts them first so that its two xdist workers end together (docs/design.md
section 8, experiments/notes/SUITE.md)."""

import os
from pathlib import Path

import pytest

from tests.runs import config

#: Test files marked `slow`, costliest first (seconds of CPU on the two-core reference machine,
#: experiments/notes/SUITE.md): end-to-end pipelines, CLI subprocesses and gloo process groups.
#: The order only schedules the work; a file missing here is merely run later and by test-fast.
SLOW = (
    "test_quickstart.py",
    "test_layouts.py",
    "test_gpu_scale.py",
    "test_methods.py",
    "test_learning.py",
    "test_readme_commands.py",
    "test_cli.py",
    "test_hf.py",
    "test_run_lifecycle.py",
    "test_bf16_params.py",
    "test_doge_authors.py",
    "test_bench_scripts.py",
    "test_doremi.py",
    "test_mixing_law_authors.py",
    "test_guardrails.py",
    "test_run_dir.py",
    "test_trainer.py",
    "test_checkpoint.py",
    "test_moe.py",
    "test_fp8.py",
    "test_host_sync.py",
    "test_model_edge_cases.py",
    "test_pipeline.py",
    "test_stay_put.py",
    "test_own_data.py",
    "test_sweep.py",
    "test_validation_split.py",
    "test_zero_optim.py",
    "test_tensor_parallel.py",
    "test_mamba.py",
    "test_mup.py",
    "test_numeric_health.py",
    "test_compare_like.py",
    "test_max_epochs.py",
    "test_report_numbers.py",
    "test_slurm.py",
    "test_packaging.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark SLOW's files `slow` and move them to the front, costliest first, each file's tests
    kept together and in order (module fixtures are built once)."""
    rank = {name: i for i, name in enumerate(SLOW)}
    for item in items:
        if item.path.name in rank:
            item.add_marker(pytest.mark.slow)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(SLOW)), order[id(item)]))


def pytest_configure(config):
    """Under xdist, the cores are shared among the workers: one worker's torch, and the processes
    its tests start, take its share of intra-op threads instead of all of them (the tests' tensors
    are too small to split, and oversubscribed threads spin on each other's cores)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        share = max(1, len(os.sched_getaffinity(0)) // int(workers))
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture(scope="session")
def stores(tmp_path_factory) -> Path:
    """Token stores of three synthetic domains (noise, repetitive, sparse Markov), built once."""
    from data.preprocess.preprocess import preprocess

    root = tmp_path_factory.mktemp("stores")
    store = root / "stores"
    preprocess(config(store, root / "unused").data, progress=False)
    return store


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module whose runs compare numbers exactly across processes
    (the same summation order everywhere)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
