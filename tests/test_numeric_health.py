"""Numbers that are not numbers (issue 41, item 5): a NaN loss stops the run naming its step and
writes no checkpoint after it; NaN/inf config values and weights that do not sum to 1 are
refused at load, one line each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.runs import config, config_path
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.records.metrics import read_jsonl
from trainer.run.health import NonFiniteError, NumericHealth

#: lr 1e30 under Adam moves every weight by about 1e30 at step 1: step 2's gradient norm (its
#: loss stays finite) is NaN, deterministically, without touching the code under test.
BLOW_UP = ["train.lr=1e30", "train.warmup_steps=0", "train.decay=constant", "train.grad_clip=0"]


def test_health_flags_the_first_non_finite_step_only():
    h = NumericHealth(torch.device("cpu"))
    h.observe(1, torch.tensor(2.0), torch.tensor(1.0))
    h.check("run")
    h.observe(2, torch.tensor(3.0), torch.tensor(float("inf")))
    h.observe(3, torch.tensor(float("nan")), torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match=r"^run: step 2: loss 3, gradient norm inf: not finite;") as e:
        h.check("run")
    assert e.value.step == 2


def test_observe_makes_no_host_sync():
    from tests.test_host_sync import HostSyncs

    h = NumericHealth(torch.device("cpu"))
    losses, norm = [torch.tensor(float("nan")), torch.tensor(1.0)], torch.tensor(1.0)
    mode = HostSyncs()
    with mode:
        for step, loss in enumerate(losses, 1):
            h.observe(step, loss, norm)
    assert mode.seen == []
    assert int(h.first) == 1


def test_a_nan_loss_stops_before_its_checkpoint(stores, tmp_path):
    """Checkpoints every step, logging every 5: the run stops at step 2, its first non-finite
    step, and step 1's checkpoint stays the latest (the old loop trained on to step 6 and wrote
    NaN checkpoints)."""
    run = tmp_path / "run"
    cfg = config(stores, run, *BLOW_UP, "train.steps=6", "checkpoint.every=1", "logging.every=5")
    with pytest.raises(NonFiniteError, match=rf"^{run}: step 2: loss \S+, gradient norm (nan|inf): not finite") as e:
        stages.train(cfg)
    assert e.value.step == 2
    assert latest_checkpoint(run).name == "step_0000001"
    assert not (run / "metrics.jsonl").exists() or read_jsonl(run / "metrics.jsonl") == []


def test_detected_at_the_next_log_step_when_no_checkpoint_comes_first(stores, tmp_path):
    run = tmp_path / "run"
    cfg = config(stores, run, *BLOW_UP, "train.steps=9", "checkpoint.every=0", "logging.every=4")
    with pytest.raises(NonFiniteError, match=r"step 2: "):
        stages.train(cfg)
    assert latest_checkpoint(run) is None  # the end-of-run checkpoint is never written
    assert read_jsonl(run / "metrics.jsonl") == []  # no row with a NaN loss


def test_cli_nan_loss_is_one_line_and_exit_2(stores, tmp_path, capsys):
    from doremi.commands.cli import main

    run = tmp_path / "run"
    path = config_path(stores, run)
    sets = [a for s in [*BLOW_UP, "train.steps=4", "checkpoint.every=1"] for a in ("--set", s)]
    assert main(["train", str(path), *sets]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"doremi train: error: {run}: step 2: loss ")
    assert latest_checkpoint(run).name == "step_0000001"


def _dp2_worker(rank: int, world: int, store: str, run: str) -> None:
    cfg = config(
        Path(store), Path(run), *BLOW_UP, "train.steps=5", "checkpoint.every=1", "logging.every=5", "parallelism.dp=2"
    )
    try:
        stages.train(cfg)
    except NonFiniteError as e:
        assert e.step == 2, e
    else:
        raise AssertionError(f"rank {rank}: no NonFiniteError")


def test_every_rank_stops_at_the_same_step_under_dp2(stores, tmp_path):
    from tests.distributed import spawn

    run = tmp_path / "dp2"
    spawn(_dp2_worker, 2, str(stores), str(run))
    assert latest_checkpoint(run).name == "step_0000001"


# -- config values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, expect",
    [
        (["train.grad_clip=.nan"], "train.grad_clip: expected a finite number, got nan"),
        (["train.grad_clip=nan"], "train.grad_clip: expected a finite number, got nan"),
        (["train.lr=.inf"], "train.lr: expected a finite number, got inf"),
        (["train.weight_decay=-.inf"], "train.weight_decay: expected a finite number, got -inf"),
        (["data.domain_weights=[1, .nan, 1]"], "data.domain_weights[1]: expected a finite number, got nan"),
        (
            ["mixing.doremi.reference_weights={noise: .inf}"],
            "mixing.doremi.reference_weights.noise: expected a finite number",
        ),
        (["pipeline.guardrails.proxy_lag=.nan"], "pipeline.guardrails.proxy_lag: expected a finite number, got nan"),
    ],
)
def test_non_finite_config_values_are_refused_naming_the_key(stores, tmp_path, sets, expect):
    from trainer.config.tools import ConfigError

    with pytest.raises(ConfigError) as e:
        config(stores, tmp_path / "run", *sets)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value)


def test_cli_nan_grad_clip_is_one_line(stores, tmp_path, capsys):
    from doremi.commands.cli import main

    path = config_path(stores, tmp_path / "run")
    assert main(["train", str(path), "--set", "train.grad_clip=nan"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "doremi train: error: train.grad_clip: expected a finite number, got nan"
    ]
    assert not (tmp_path / "run").exists()


# -- weights that do not sum to 1 ----------------------------------------------------------------


def test_a_weights_file_summing_to_0_7_is_refused(stores, tmp_path):
    from data.errors import DataError

    path = tmp_path / "w.json"
    path.write_text(json.dumps({"domains": ["noise", "easy", "markov"], "weights": [0.2, 0.2, 0.3]}))
    cfg = config(stores, tmp_path / "run", f"data.domain_weights={path}")
    with pytest.raises(DataError, match=rf"^{path}: weights sum to 0.7, not 1"):
        stages.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    doc = {"domains": ["noise", "easy", "markov"], "weights": [0.2, 0.2, 0.3], "normalize": True}
    path.write_text(json.dumps(doc))
    stages.train(config(stores, tmp_path / "run2", f"data.domain_weights={path}", "train.steps=1"))
    rows = [r for r in read_jsonl(tmp_path / "run2" / "metrics.jsonl") if "realised" in r]
    assert rows[-1]["realised"]["nominal_sequences"]["markov"] == pytest.approx(8 * 3 / 7)


def test_weights_rules():
    from data.errors import DataError
    from data.sampling.weights import check_sum

    domains = ["a", "b", "c"]
    assert check_sum([1, 1, 2], domains, "k").tolist() == [0.25, 0.25, 0.5]  # whole-number ratios
    assert check_sum([0.2, 0.3, 0.5], domains, "k").tolist() == pytest.approx([0.2, 0.3, 0.5])
    # rounded published weights (the Pile's sum to 1.0016): within 1% of 1, rescaled
    assert math.fsum(check_sum([0.5004, 0.3004, 0.2008], domains, "k")) == pytest.approx(1.0, abs=1e-12)
    for bad, total in (([0.2, 0.2, 0.3], "0.7"), ([0.5, 0.5, 0.5], "1.5"), ([0.5, 1, 2.5], "4")):
        with pytest.raises(DataError, match=rf"^k: weights sum to {total}, not 1"):
            check_sum(bad, domains, "k")
    assert check_sum([0.2, 0.2, 0.3], domains, "k", normalize=True).tolist() == pytest.approx([2 / 7, 2 / 7, 3 / 7])
