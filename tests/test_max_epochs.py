"""`data.max_epochs`: the main run reads its fixed mixture capped so that no domain repeats
more than that many epochs over the run's budget (data/mixtures.py epoch_capped)."""

import numpy as np

from data.mixtures import epoch_capped
from tests.runs import config


def test_a_main_run_reads_its_mixture_capped_and_says_which_domains_moved(stores, tmp_path, capsys):
    from trainer.loop import Trainer

    cfg = config(stores, tmp_path / "run", "data.domain_weights=[0.9, 0.05, 0.05]")
    tokens = np.array([d.train.tokens for d in Trainer(cfg, stage="train").feed.manifest.domains], dtype=np.float64)
    assert tokens[0] / tokens.sum() < 0.6  # so that the cap below binds on the first domain
    max_epochs = 1.5 * cfg.budget_tokens / tokens.sum()
    capped = config(
        stores, tmp_path / "capped", "data.domain_weights=[0.9, 0.05, 0.05]", f"data.max_epochs={max_epochs}"
    )
    capsys.readouterr()
    weights = Trainer(capped, stage="train").hook.sampling_weights(1)
    want = epoch_capped([0.9, 0.05, 0.05], tokens, cfg.budget_tokens, max_epochs)
    assert np.array_equal(weights, want) and weights[0] == max_epochs * tokens[0] / cfg.budget_tokens
    assert np.isclose(weights.sum(), 1.0, rtol=0, atol=1e-12)
    assert f"data.max_epochs {max_epochs:g}: the mixture is capped: " in capsys.readouterr().err
