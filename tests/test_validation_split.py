"""The dev/test validation split (data/store/validation_split.py, docs/design.md 3b): by document,
deterministic, each half packed on its own; methods and fits read dev, the verdict test, a method
asking for test is refused; the per-sequence file of an evaluation reproduces its logged loss."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from data.errors import DataError, UserError
from data.store.store import open_stores
from data.store.validation_split import (
    CONSUMERS,
    DEV,
    TEST,
    MethodSplitError,
    dev_mask,
    half_documents,
    sequence_documents,
    split_for,
)
from tests.distributed import spawn
from tests.runs import config
from tests.toy_method import LossChaser
from trainer.feed.data_feed import DataFeed
from trainer.parallel.context import ParallelContext
from trainer.records.eval_sequences import read_sequence_losses, sequence_file
from trainer.records.metrics import read_jsonl
from trainer.run.hooks import Needs

SPLIT = ["data.validation_split=dev_test"]

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the split, pure ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 10, 101])
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_split_is_deterministic_covers_every_document_once_and_is_about_half(n, fraction):
    mask = dev_mask(n, fraction, seed=1234, domain="prose")
    assert np.array_equal(mask, dev_mask(n, fraction, seed=1234, domain="prose"))
    dev = half_documents(DEV, n, fraction, 1234, "prose")
    test = half_documents(TEST, n, fraction, 1234, "prose")
    assert sorted(np.concatenate([dev, test]).tolist()) == list(range(n))
    assert not set(dev.tolist()) & set(test.tolist())
    assert len(dev) == min(max(1, round(fraction * n)), n - 1) and len(test) >= 1


def test_split_depends_on_the_seed_and_the_domain_name_only():
    a = dev_mask(200, 0.5, 1234, "prose")
    assert a.sum() == 100
    assert not np.array_equal(a, dev_mask(200, 0.5, 1235, "prose"))
    assert not np.array_equal(a, dev_mask(200, 0.5, 1234, "code"))


def test_a_domain_too_small_to_split_or_a_bad_fraction_is_one_line():
    with pytest.raises(DataError, match="domain 'x' has 1 validation document"):
        dev_mask(1, 0.5, 0, "x")
    with pytest.raises(DataError, match="data.dev_fraction: expected a value in \\(0, 1\\), got 1.0"):
        dev_mask(4, 1.0, 0, "x")


def test_the_consumer_table_gives_methods_and_fits_dev_and_the_verdict_test():
    assert {c: split_for(c, "dev_test") for c in CONSUMERS} == {
        "method_probe": "dev",
        "method_target": "dev",
        "search_run": "dev",
        "sweep_run": "dev",
        "verdict": "test",
    }
    assert {split_for(c, "none") for c in CONSUMERS} == {"all"}


def test_sequence_documents_by_label_tokens():
    # Stream of documents 7 (positions 0..4), 9 (5..9), 12 (10..12); seq_len 4: sequence i's
    # labels are positions 4i+1 .. 4i+4 (the last one cut at the stream's end).
    first, last = sequence_documents(np.array([0, 5, 10, 13]), np.array([7, 9, 12]), 3, 4, 13)
    assert first.tolist() == [7, 9, 9] and last.tolist() == [7, 9, 12]


# -- the halves on real stores ----------------------------------------------------------------


def half_stream(stores, domain: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documents `ids` of a domain's validation split, concatenated, and their offsets: built
    here from the store's files, apart from the code under test."""
    idx = np.asarray(stores.documents(domain, "validation"))
    tokens = np.asarray(stores.tokens(domain, "validation"), dtype=np.int64)
    parts = [tokens[idx[j] : idx[j + 1]] for j in ids]
    return np.concatenate(parts), np.concatenate([[0], np.cumsum([len(p) for p in parts])])


def row_documents(batches: list[dict], stores, half: str, seq_len: int) -> set[tuple[str, int]]:
    """(domain, document id) of every label token of every row, after checking that each row's
    tokens are those of its sequence in the half's own stream."""
    seed, out = 1234, set()
    for b in batches:
        for r, (d, i) in enumerate(b["items"].tolist()):
            domain = stores.domains[d]
            n = stores.manifest.domain(domain).validation.documents
            ids = half_documents(half, n, 0.5, seed, domain)
            stream, offsets = half_stream(stores, domain, ids)
            labels = b["labels"][r]
            labels = labels[labels != -100].numpy()
            window = np.concatenate([b["input_ids"][r, :1].numpy(), labels])
            assert np.array_equal(window, stream[i * seq_len : i * seq_len + len(window)]), (domain, i)
            positions = np.arange(i * seq_len + 1, i * seq_len + 1 + len(labels))
            docs = ids[np.searchsorted(offsets, positions, side="right") - 1]
            out |= {(domain, int(x)) for x in docs}
    return out


def all_documents(stores, half: str) -> set[tuple[str, int]]:
    return {
        (d, int(j))
        for d in stores.domains
        for j in half_documents(half, stores.manifest.domain(d).validation.documents, 0.5, 1234, d)
    }


def test_method_reads_dev_only_and_the_verdict_test_only_by_document(stores, tmp_path, monkeypatch):
    """Aioli-style probes (the toy method's validation losses, online on a main run) and the
    run's own evaluation, as the trainer hands them over; then DoGE's target batches."""
    import trainer.run.loop as loop

    calls: list[tuple[str, list[list[dict]]]] = []
    tag = ["verdict"]
    real_eval, real_probe = loop.evaluate_domains, loop.Trainer.method_validation

    def spy_eval(model, batches, pc, autocast=None):
        calls.append((tag[0], batches))
        return real_eval(model, batches, pc, autocast)

    def spy_probe(self, step):
        tag[0] = "method"
        try:
            real_probe(self, step)
        finally:
            tag[0] = "verdict"

    monkeypatch.setattr(loop, "evaluate_domains", spy_eval)
    monkeypatch.setattr(loop.Trainer, "method_validation", spy_probe)
    cfg = config(stores, tmp_path / "run", *SPLIT, "train.steps=2", "train.eval_every=1", "train.eval_sequences=0")
    loop.Trainer(cfg, stage="train", method=LossChaser).fit()
    assert [t for t, _ in calls] == ["method", "verdict", "method", "verdict"]  # steps 0, 1, 2, 2

    s = open_stores(stores)
    seen = {t: set() for t in ("method", "verdict")}
    for t, per_domain in calls:
        seen[t] |= row_documents([b for bs in per_domain for b in bs], s, DEV if t == "method" else TEST, 32)
    dev, test = all_documents(s, DEV), all_documents(s, TEST)
    assert not dev & test
    assert seen["method"] == dev  # every dev document, nothing else
    assert seen["verdict"] == test  # eval_sequences=0: the whole test half
    assert not seen["method"] & seen["verdict"]

    feed = DataFeed(config(stores, tmp_path / "feed", *SPLIT).data, 8, 1, ParallelContext.single(), seed=0)
    target = feed.target_batches(3, np.array([0.2, 0.3, 0.5]), 24, 8)
    assert sum(b["input_ids"].shape[0] for b in target) == 24
    docs = row_documents(target, s, DEV, 32)
    assert docs and docs <= dev


def test_default_arrangement_packs_the_whole_validation_split_as_before(stores, tmp_path):
    from data.store.dataset import PackedDomains
    from data.store.validation import validation_batches

    feed = DataFeed(config(stores, tmp_path / "feed").data, 8, 1, ParallelContext.single(), seed=0)
    whole = PackedDomains(open_stores(stores), "validation", 32)
    for consumer in CONSUMERS:
        got = feed.validation(4, 0, consumer)
        for d in range(feed.k):
            want = list(validation_batches(whole, d, 4))
            assert len(got[d]) == len(want)
            assert all(torch.equal(a[key], b[key]) for a, b in zip(got[d], want) for key in a)


class AsksForTest(LossChaser):
    needs = Needs(validation=True, validation_split="test")


def test_a_method_asking_for_test_data_is_refused(stores, tmp_path):
    from trainer.run.loop import Trainer

    cfg = config(stores, tmp_path / "run", *SPLIT)
    with pytest.raises(MethodSplitError) as e:
        Trainer(cfg, stage="train", method=AsksForTest)
    assert isinstance(e.value, UserError)
    assert str(e.value) == (
        "method AsksForTest: asks for the 'test' validation split; a method reads only 'dev' "
        "(the verdict is computed on 'test'; docs/design.md 3b)"
    )


# -- per-sequence losses ------------------------------------------------------------------------


def check_sequence_file(run: Path, stores: Path, steps: int) -> dict[str, np.ndarray]:
    rows = read_jsonl(run / "metrics.jsonl")
    val = next(r for r in reversed(rows) if "val_loss" in r)
    f = read_sequence_losses(sequence_file(run, steps))
    assert int(f["step"]) == steps and str(f["split"]) == "test"
    s = open_stores(stores)
    test = all_documents(s, TEST)
    for d, name in enumerate(f["domains"].tolist()):
        mine = f["domain"] == d
        assert math.fsum(f["loss_sum"][mine]) / int(f["tokens"][mine].sum()) == val["val_loss"][name]
        assert f["sequence"][mine].tolist() == list(range(int(mine.sum())))
        assert {(name, int(x)) for x in np.concatenate([f["doc_first"][mine], f["doc_last"][mine]])} <= test
    return f


def test_the_sequence_file_reproduces_the_logged_val_loss_exactly(stores, tmp_path):
    from doremi.pipeline import stages

    run = tmp_path / "run"
    stages.train(
        config(stores, run, *SPLIT, "train.eval_sequence_losses=final", "train.eval_sequences=8", "train.eval_every=3")
    )
    f = check_sequence_file(run, stores, 3)
    assert len(f["loss_sum"]) == 3 * 8 and set(f["tokens"].tolist()) == {32}
    assert sorted(p.name for p in (run / "eval_sequences").iterdir()) == ["step_0000003.npz"]


def _dp2(rank: int, world: int, store: str, run: str) -> None:
    from doremi.pipeline import stages

    stages.train(
        config(
            Path(store), Path(run), *SPLIT, "train.eval_sequence_losses=final", "train.eval_every=3", "parallelism.dp=2"
        )
    )


def test_the_sequence_file_under_dp2_is_the_single_process_evaluation(stores, tmp_path):
    """Gathered over dp, the rows are each sequence's own sum: the same numbers a single process
    gets from the run's final checkpoint."""
    from trainer.build import build_model
    from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint
    from trainer.run.evaluate import evaluate_sequences

    run = tmp_path / "dp2"
    spawn(_dp2, 2, str(stores), str(run))
    f = check_sequence_file(run, stores, 3)
    cfg = config(stores, tmp_path / "single", *SPLIT)
    pc = ParallelContext.single()
    model = build_model(cfg, pc)
    load_checkpoint(latest_checkpoint(run), model, None, pc)
    feed = DataFeed(cfg.data, 8, 1, pc, seed=0)
    per_sequence = evaluate_sequences(model, feed.validation(4, 16, "verdict"), pc)  # dp2's micro-batch
    assert np.array_equal(np.concatenate([loss for loss, _ in per_sequence]), f["loss_sum"])


def test_sweep_runs_and_search_runs_evaluate_on_dev_main_runs_on_test(stores, tmp_path, monkeypatch):
    from trainer.run.loop import Trainer
    from trainer.stacked.train import train_stacked

    asked: list[str] = []
    real = DataFeed.validation

    def spy(self, batch_size, sequences, consumer):
        asked.append(self.validation_half(consumer))
        return real(self, batch_size, sequences, consumer)

    monkeypatch.setattr(DataFeed, "validation", spy)
    cfg = config(stores, tmp_path / "sweep", *SPLIT, "train.steps=1")
    train_stacked(cfg, np.array([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]]), keep_params=False)
    assert asked == [DEV]
    stage_halves = {}
    for stage in ("reference", "proxy", "train"):
        asked.clear()
        Trainer(config(stores, tmp_path / stage, *SPLIT, "train.eval_every=1"), stage=stage)
        stage_halves[stage] = asked[:]
    assert stage_halves == {"reference": [DEV], "proxy": [DEV], "train": [TEST]}
    asked.clear()
    Trainer(config(stores, tmp_path / "one", *SPLIT, "train.eval_every=1"), evaluation="sweep_run")
    assert asked == [DEV]  # a sweep run trained one by one (doremi.offline.sweep.Sweep.run_one)
