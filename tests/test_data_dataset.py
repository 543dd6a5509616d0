import json

import numpy as np
import pytest
import torch

from data.config import DataConfig, DomainSource
from data.preprocess.preprocess import preprocess
from data.store.batch import IGNORE_INDEX, collate
from data.store.dataset import PAD, PackedDomains
from data.store.store import open_stores
from data.store.validation import validation_batches


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    domains = []
    for name, n in (("a", 30), ("b", 12)):
        path = tmp / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name} doc {i} " + "x" * (i % 9)}) + "\n" for i in range(n)))
        domains.append(DomainSource(name=name, paths=[str(path)]))
    cfg = DataConfig(domains=domains, store_dir=str(tmp / "stores"), num_proc=1, validation_fraction=0.2)
    preprocess(cfg, progress=False)
    return open_stores(cfg.store_dir)


def test_packed_sequences_tile_the_stream(stores):
    ds = PackedDomains(stores, "train", seq_len=16)
    for d, name in enumerate(ds.domains):
        stream = np.asarray(stores.tokens(name, "train"), dtype=np.int64)
        n = ds.num_sequences(d)
        assert n == (len(stream) - 1) // 16
        seqs = [ds.sequence(d, i) for i in range(n)]
        assert all(s.shape == (17,) and s.dtype == np.int64 for s in seqs)
        assert np.array_equal(np.concatenate([s[:-1] for s in seqs] + [seqs[-1][-1:]]), stream[: n * 16 + 1])
    with pytest.raises(IndexError):
        ds.sequence(0, ds.num_sequences(0))


def test_collate_shifts_labels_and_marks_domains(stores):
    ds = PackedDomains(stores, "train", seq_len=16)
    items = [(0, 0), (1, 2), (0, 3)]
    batch = collate(ds, items)
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 16)
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert batch["domain_ids"].tolist() == [0, 1, 0]
    for row, (d, i) in enumerate(items):
        seq = torch.from_numpy(ds.sequence(d, i))
        assert torch.equal(batch["input_ids"][row], seq[:-1]) and torch.equal(batch["labels"][row], seq[1:])
    assert collate(ds, items, device="cpu")["labels"].device.type == "cpu"


def test_validation_pads_the_last_sequence_and_iterates_in_order(stores):
    ds = PackedDomains(stores, "validation", seq_len=16)
    d = 1
    stream = np.asarray(stores.tokens("b", "validation"), dtype=np.int64)
    n = ds.num_sequences(d)
    assert n == -(-(len(stream) - 1) // 16)
    pad = n * 16 + 1 - len(stream)
    last = ds.sequence(d, n - 1)
    assert (last == PAD).sum() == pad
    batches = list(validation_batches(ds, d, batch_size=2))
    assert [b["input_ids"].shape[0] for b in batches] == [2] * (n // 2) + ([n % 2] if n % 2 else [])
    labels = torch.cat([b["labels"] for b in batches]).flatten()
    assert (labels == IGNORE_INDEX).sum().item() == pad
    assert torch.equal(labels[labels != IGNORE_INDEX], torch.from_numpy(stream[1:]))
    assert len(list(validation_batches(ds, d, batch_size=1, max_batches=2))) == min(2, n)
    assert [torch.equal(x["labels"], y["labels"]) for x, y in zip(batches, validation_batches(ds, d, 2))] == [
        True
    ] * len(batches)
    assert PackedDomains(stores, "train", 16).pad_last is False
