"""The token-id check of opened stores reads the file in blocks (data/store/store.py
first_id_at_least, issue 42: a reduction over a memory map of a multi-GB split counted every page
in the resident set): the same position as a whole-array search, across block boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from data.store import store


@pytest.mark.parametrize("block", [1, 3, 4, 1 << 24])
def test_the_first_id_at_or_above_the_limit_across_blocks(tmp_path, monkeypatch, block):
    monkeypatch.setattr(store, "CHECK_TOKENS", block)
    ids = np.array([5, 7, 299, 0, 300, 301, 2, 999], dtype="<u2")
    path = tmp_path / "train.bin"
    ids.tofile(path)
    assert store.first_id_at_least(path, np.dtype("<u2"), 300) == 4
    assert store.first_id_at_least(path, np.dtype("<u2"), 299) == 2
    assert store.first_id_at_least(path, np.dtype("<u2"), 1000) is None
    (tmp_path / "empty.bin").write_bytes(b"")
    assert store.first_id_at_least(tmp_path / "empty.bin", np.dtype("<u2"), 1) is None
