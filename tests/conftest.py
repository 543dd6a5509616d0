from pathlib import Path

import pytest

from tests.runs import config


@pytest.fixture(scope="session")
def stores(tmp_path_factory) -> Path:
    """Token stores of three synthetic domains (noise, repetitive, sparse Markov), built once."""
    from data.preprocess import preprocess

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
