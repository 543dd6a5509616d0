"""`data.max_epochs`: the main run reads its fixed mixture capped so that no domain repeats
more than that many epochs, counted as the run realises them: sequences drawn over the
sampler's pool (data/sampling/mixtures.py sequence_capped)."""

import numpy as np

from data.sampling.mixtures import sequence_capped
from tests.runs import config
from trainer.records.metrics import read_jsonl


def test_a_capped_main_run_reads_at_most_max_epochs_of_every_domain(stores, tmp_path, capsys):
    from doremi.reports.summary import read_mixture
    from trainer.run.loop import Trainer

    steps, batch = 12, 8
    sets = ("data.domain_weights=[0.9, 0.05, 0.05]", f"train.steps={steps}", "checkpoint.every=0")
    pools = Trainer(config(stores, tmp_path / "run", *sets), stage="train").feed.sampler.num_sequences
    max_epochs = 0.6 * steps * batch / pools[0]  # domain 0 asks 0.9 of the run: 1.5x its cap
    assert (max_epochs * pools[1] + max_epochs * pools[2] - 2) / (steps * batch) > 0.2  # so the cap is feasible
    capped = config(stores, tmp_path / "capped", *sets, f"data.max_epochs={max_epochs}")
    capsys.readouterr()
    trainer = Trainer(capped, stage="train")
    weights = trainer.hook.sampling_weights(1)
    assert np.array_equal(weights, sequence_capped([0.9, 0.05, 0.05], pools, steps * batch, max_epochs))
    assert weights[0] == (max_epochs * pools[0] - 1) / (steps * batch)
    assert f"data.max_epochs {max_epochs:g}: the mixture is capped: " in capsys.readouterr().err
    trainer.fit()
    epochs = [r["epochs"] for r in read_jsonl(tmp_path / "capped" / "metrics.jsonl") if "epochs" in r][-1]
    read = [epochs[d] for d in trainer.feed.domains]
    assert max(read) <= max_epochs and read[0] >= max_epochs - 2 / pools[0]
    np.testing.assert_allclose(read_mixture(tmp_path / "capped", trainer.feed.domains), weights, rtol=0, atol=1e-12)
