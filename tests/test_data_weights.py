import json

import numpy as np
import pytest

from data.errors import DataError
from data.sampling.weights import resolve_weights
from data.store.store import DomainEntry, Manifest, SplitCounts


def manifest(train_tokens: dict[str, int]) -> Manifest:
    """A store's manifest of these domains' train tokens (one sequence each, no validation):
    what the weights read of a store."""
    domains = [DomainEntry(n, "test", SplitCounts(t, 1), SplitCounts(0, 0)) for n, t in train_tokens.items()]
    return Manifest(domains=domains, tokenizer={"name": "byte"}, dtype="uint16", fingerprint="x")


MANIFEST = manifest({"a": 100, "b": 300, "c": 600})


def test_forms(tmp_path):
    assert resolve_weights("uniform", MANIFEST).tolist() == pytest.approx([1 / 3] * 3)
    assert resolve_weights("tokens", MANIFEST).tolist() == pytest.approx([0.1, 0.3, 0.6])
    assert resolve_weights([1, 1, 2], MANIFEST).tolist() == [0.25, 0.25, 0.5]
    assert resolve_weights({"c": 2, "a": 1, "b": 1}, MANIFEST).tolist() == [0.25, 0.25, 0.5]
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"domains": ["c", "b", "a"], "weights": [0.5, 0.3, 0.2], "steps": 10}))
    assert resolve_weights(str(path), MANIFEST).tolist() == pytest.approx([0.2, 0.3, 0.5])
    assert isinstance(resolve_weights("uniform", MANIFEST), np.ndarray)


@pytest.mark.parametrize(
    "spec, message",
    [
        ([1, -1, 1], r"finite and >= 0, got b=-1.0"),
        ([1, float("nan"), 1], r"finite and >= 0, got b=nan"),
        ([1, 1], r"expected 3 weights \(domains a, b, c\), got 2"),
        ([0, 0, 0], "all zero"),
        ({"a": 1, "b": 1, "z": 1}, "unknown: z; missing: c"),
        ("missing.json", "weights file missing.json not found"),
    ],
)
def test_bad_weights(spec, message):
    with pytest.raises(DataError, match=message):
        resolve_weights(spec, MANIFEST)


def test_bad_weights_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"domains": ["a", "b"], "weights": [0.5, 0.5]}))
    with pytest.raises(DataError, match="missing: c"):
        resolve_weights(str(path), MANIFEST)
    path.write_text(json.dumps({"weights": [1, 1, 1]}))
    with pytest.raises(DataError, match="expected JSON with 'domains' and 'weights'"):
        resolve_weights(str(path), MANIFEST)
