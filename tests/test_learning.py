"""A tiny model on the quickstart stores learns more than token frequencies: its validation loss
on the real domains goes clearly below their unigram entropy (issue 3; the 2-minute figures are
in experiments/notes/FOUNDATION.md)."""

from data.preprocess.preprocess import preprocess
from data.store.stats import unigram_entropy
from data.store.store import open_stores
from doremi.config import ExperimentConfig
from doremi.pipeline import stages
from tests.paths import QUICKSTART
from trainer.config.schema import load_config


def test_tiny_model_goes_below_unigram_entropy(tmp_path):
    cfg = load_config(
        QUICKSTART,
        [
            f"data.store_dir={tmp_path / 'stores'}",
            f"train.run_dir={tmp_path / 'run'}",
            "train.steps=160",
            "train.eval_every=160",
            "logging.progress=false",
        ],
        cls=ExperimentConfig,
    )
    preprocess(cfg.data, progress=False)
    val = stages.train(cfg)["val_loss"]
    stores = open_stores(cfg.data.store_dir)
    for domain in ("code", "docs", "notes", "markov", "repeat"):
        h1 = unigram_entropy(stores, domain)
        assert val[domain] < h1 - 0.3, (domain, val[domain], h1)
