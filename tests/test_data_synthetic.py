import math

import numpy as np
import pytest

from data.config import DataConfig, DomainSource, SyntheticSpec, TokenizerConfig
from data.errors import DataError
from data.preprocess.preprocess import preprocess
from data.sources.synthetic import entropy, markov_table, symbol_ids
from data.store.stats import empirical_entropy
from data.store.store import open_stores

SPECS = {
    "noise": SyntheticSpec(kind="noise", num_tokens=200_000, vocab=64, seed=1),
    "repeat": SyntheticSpec(kind="repeat", num_tokens=50_000, vocab=32, seed=2),
    "markov": SyntheticSpec(kind="markov", num_tokens=300_000, vocab=16, order=2, branching=3, seed=3),
}
ORDER = {"noise": 0, "repeat": 1, "markov": 2}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synthetic")
    cfg = DataConfig(
        domains=[DomainSource(name=n, synthetic=s) for n, s in SPECS.items()],
        tokenizer=TokenizerConfig(kind="byte"),
        store_dir=str(tmp / "stores"),
        num_proc=1,
    )
    preprocess(cfg, progress=False)
    return open_stores(cfg.store_dir)


def test_recorded_entropy(stores):
    m = stores.manifest
    assert m.domain("noise").entropy == pytest.approx(math.log(64), abs=1e-12)
    assert m.domain("repeat").entropy == 0.0
    assert m.domain("markov").entropy == pytest.approx(math.log(3), abs=1e-12)
    assert m.domain("markov").synthetic["order"] == 2 and m.domain("markov").synthetic["eos_id"] == 256


@pytest.mark.parametrize("name", list(SPECS))
def test_empirical_entropy_matches_recorded(stores, name):
    docs = [stores.document(name, "train", i) for i in range(stores.manifest.domain(name).train.documents)]
    recorded = stores.manifest.domain(name).entropy
    got = empirical_entropy(docs, ORDER[name])
    if recorded == 0:
        assert got == pytest.approx(0.0, abs=1e-12)
    else:
        assert abs(got - recorded) <= 0.02 * recorded
    assert max(int(d.max()) for d in docs) == SPECS[name].vocab - 1  # ids below EOS=256 map to themselves


def test_markov_needs_its_context():
    """Learnable but hard: the order-2 context gives log(branching); one token of context does not."""
    spec = SPECS["markov"]
    from data.sources.synthetic import markov

    stream = markov(spec)
    assert empirical_entropy([stream], 2) == pytest.approx(math.log(3), rel=0.01)
    assert empirical_entropy([stream], 1) > math.log(3) + 0.5
    table = markov_table(spec)
    assert table.shape == (256, 3) and all(len(set(row)) == 3 for row in table.tolist())


def test_symbol_ids_skip_eos_and_entropy_formula():
    assert symbol_ids(np.arange(5), eos_id=2).tolist() == [0, 1, 3, 4, 5]
    assert symbol_ids(np.arange(3), eos_id=0).tolist() == [1, 2, 3]
    assert entropy(SyntheticSpec(kind="markov", branching=5)) == pytest.approx(math.log(5))


def test_bad_synthetic_specs():
    from trainer.config.tools import from_dict

    with pytest.raises(DataError, match="branching: expected at most vocab=4, got 5"):
        from_dict(
            DataConfig,
            {"domains": [{"name": "m", "synthetic": {"kind": "markov", "vocab": 4, "branching": 5}}]},
            "data",
        )
    with pytest.raises(DataError, match=r"vocab\*\*\(order\+1\)"):
        markov_table(SyntheticSpec(kind="markov", vocab=1000, order=3))
