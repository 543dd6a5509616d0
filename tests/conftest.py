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
