"""`data.max_epochs`: the main run reads its fixed mixture capped so that no domain repeats
more than that many epochs, counted as the run realises them: sequences drawn over the
sampler's pool (data/sampling/mixtures.py sequence_capped)."""

import numpy as np
import pytest

from data.errors import DataError
from data.sampling.mixtures import sequence_capped
from data.sampling.pools import pool_sizes
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


def test_a_capped_fixed_mixture_draws_the_same_batches_with_and_without_the_runtime_cap(stores, tmp_path):
    """`sequence_capped` keeps the exact sampler's slack, so the sampler's own caps, which every
    run under `data.max_epochs` has, never move a draw of a capped fixed mixture over a full run."""
    from data.sampling.sampler import DomainBatchSampler
    from trainer.run.loop import Trainer

    steps, batch = 12, 8
    sets = ("data.domain_weights=[0.9, 0.05, 0.05]", f"train.steps={steps}", "checkpoint.every=0")
    pools = Trainer(config(stores, tmp_path / "run", *sets), stage="train").feed.sampler.num_sequences
    max_epochs = 0.6 * steps * batch / pools[0]
    trainer = Trainer(config(stores, tmp_path / "capped", *sets, f"data.max_epochs={max_epochs}"), stage="train")
    sampler = trainer.feed.sampler
    assert sampler.caps == [int(max_epochs * n) for n in pools]
    drawn: list[list[tuple[int, int]]] = []
    draw = sampler.global_batch

    def recording(step, weights, draws="exact"):
        drawn.append(draw(step, weights, draws))
        return drawn[-1]

    sampler.global_batch = recording
    trainer.fit()
    weights = trainer.hook.sampling_weights(1)
    plain = DomainBatchSampler(sampler.num_sequences, batch, sampler.seed, pools=sampler.pools)
    assert drawn == [plain.global_batch(t, weights) for t in range(steps)]
    assert sampler.cursors == plain.cursors and sampler.deficits == plain.deficits
    assert sampler.cursors[0] >= sampler.caps[0] - 2  # the domain the mixture capped ends at its cap


def test_an_online_method_reads_no_domain_past_max_epochs(stores, tmp_path, capsys):
    """ODM (random draws) online with caps that bind on two domains: every domain's realised
    epochs stay within the cap, each exhausted domain is announced once and recorded with its
    step, the batch stays whole, and the bandit divides its rewards by the probabilities the
    sequences were drawn with (0 for an exhausted domain), not by its policy's."""
    from doremi.methods.history import read_history
    from doremi.pipeline import stages

    steps, batch = 12, 8
    sets = ["mixing.main=odm", f"train.steps={steps}", "checkpoint.every=0", "train.eval_sequences=4"]
    pools = pool_sizes(config(stores, tmp_path / "probe").data)
    max_epochs = 100 / sum(pools)  # 100 sequences in all for a run of 96: the smaller pools run out
    caps = [int(max_epochs * n) for n in pools]
    assert sum(caps) >= steps * batch and min(caps) < steps * batch / 3
    run = tmp_path / "odm"
    capsys.readouterr()
    stages.train(config(stores, run, *sets, f"data.max_epochs={max_epochs}"))
    err = capsys.readouterr()
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "epochs" in r]
    last = rows[-1]
    domains = list(last["epochs"])
    assert all(last["epochs"][d] <= max_epochs for d in domains)
    assert [last["realised"]["sequences"][d] for d in domains] != caps  # not every pool ran out
    assert sum(last["realised"]["sequences"].values()) == steps * batch
    exhausted = {d: t for d, t in last["exhausted"].items() if t is not None}
    assert exhausted and all(last["realised"]["sequences"][d] == caps[domains.index(d)] for d in exhausted)
    for d, t in exhausted.items():
        line = f"data.max_epochs {max_epochs:g}: domain {d!r} read "
        assert err.err.count(line) == 1 and f"at step {t}; the other domains take its share" in err.err
    assert "read to data.max_epochs: " + ", ".join(f"{d} at step {t}" for d, t in exhausted.items()) in err.out
    history = read_history(run)
    for h in history:
        i = {d: domains.index(d) for d in exhausted}
        for d, t in exhausted.items():
            if h["step"] > t:
                assert h["sampling"][i[d]] == 0.0 and h["sequences"][i[d]] == 0
        assert abs(sum(h["sampling"]) - 1) < 1e-12 and sum(h["sequences"]) == batch
    assert min(exhausted.values()) < steps
    assert any(h["sampling"] != h_prev["weights"] for h_prev, h in zip(history, history[1:]))


def test_a_run_that_needs_more_than_the_pools_hold_is_refused_before_step_0(stores, tmp_path):
    from doremi.pipeline import stages

    steps = 12
    sets = ["mixing.main=odm", f"train.steps={steps}", "checkpoint.every=0"]
    pools = pool_sizes(config(stores, tmp_path / "probe").data)
    max_epochs = 90 / sum(pools)
    held = sum(int(max_epochs * n) for n in pools)
    with pytest.raises(DataError) as e:
        stages.train(config(stores, tmp_path / "odm", *sets, f"data.max_epochs={max_epochs}"))
    assert str(e.value) == (
        f"data.max_epochs {max_epochs:g}: the pools hold {held} sequences at {max_epochs:g} epochs each, fewer "
        f"than train.steps x train.global_batch_size = 12 x 8 = 96; raise data.max_epochs, add data or shorten the run"
    )
    assert not (tmp_path / "odm" / "metrics.jsonl").exists()


def test_pipeline_stages_may_set_max_epochs_and_the_stores_do_not_depend_on_it(stores, tmp_path):
    """`data.max_epochs` changes how a run draws, not the stores: `pipeline.main` and
    `pipeline.proxy` may set it (the study caps its main runs there) and the preprocess stage's
    fingerprint does not read it, so changing it rebuilds nothing."""
    from doremi.outputs.fingerprint import store_keys
    from doremi.pipeline.pipeline import Pipeline
    from tests.runs import config_path

    exp = config_path(stores, tmp_path / "run")
    sets = [
        f"pipeline.run_dir={tmp_path / 'root'}",
        "pipeline.main.data.max_epochs=2",
        "pipeline.proxy.data.max_epochs=3",
    ]
    pipe = Pipeline(exp, sets)
    assert pipe.stage_config(pipe.p.main).data.max_epochs == 2.0
    assert pipe.stage_config(pipe.p.proxy).data.max_epochs == 3.0
    assert store_keys(config(stores, tmp_path / "a", "data.max_epochs=2")) == store_keys(config(stores, tmp_path / "b"))
