"""Config loading: typed sections, --set coercion, and one-line errors naming the key path."""

from pathlib import Path

import pytest

from doremi.config import ExperimentConfig
from trainer.config.schema import load_config
from trainer.config.tools import ConfigError, absolute_paths, dump_yaml


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


DOMAINS = "data: {domains: [{name: a, paths: [a.txt]}]}\n"


def load(tmp_path, text, *sets):
    return load_config(write(tmp_path, text), ["data.domains=[{name: a, paths: [a.txt]}]", *sets], cls=ExperimentConfig)


def error(tmp_path, text, *sets) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text, *sets)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_sections_and_coercion(tmp_path):
    cfg = load(
        tmp_path,
        "model: {preset: tiny}\ntrain: {steps: 5, lr: 1}\n",
        "train.lr=3e-4",
        "parallelism.tp=2",
        "mixing.doremi.eta=0.5",
        "data.domain_weights=[0.5, 0.5]",
    )
    assert cfg.train.steps == 5 and cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.parallelism.tp == 2 and cfg.mixing.doremi.eta == 0.5
    assert cfg.data.domain_weights == [0.5, 0.5]
    assert cfg.model.d_model == 64  # from the preset


def test_preset_values_overridden_by_file(tmp_path):
    cfg = load(tmp_path, "model: {preset: llama3-70b, n_layers: 4}\ndata: {seq_len: 128}\n")
    assert cfg.model.n_layers == 4 and cfg.model.d_model == 8192 and cfg.model.rope_scaling.factor == 8.0


def test_unknown_key_suggests_closest(tmp_path):
    msg = error(tmp_path, "train: {lrr: 0.1}\n")
    assert "unknown key train.lrr" in msg and "did you mean train.lr?" in msg


def test_unknown_section(tmp_path):
    assert "did you mean parallelism?" in error(tmp_path, "paralelism: {tp: 2}\n")


def test_wrong_type_names_path_expected_and_given(tmp_path):
    msg = error(tmp_path, "train: {steps: ten}\n")
    assert msg.startswith("train.steps: expected int, got 'ten' (str)")


def test_wrong_type_from_set(tmp_path):
    assert "parallelism.sequence_parallel: expected bool" in error(tmp_path, "", "parallelism.sequence_parallel=maybe")


def test_literal_choice(tmp_path):
    msg = error(tmp_path, "parallelism: {recompute: ful}\n")
    assert "parallelism.recompute: expected one of 'none', 'selective', 'full'" in msg and "did you mean 'full'" in msg


def test_tp_must_divide_heads(tmp_path):
    msg = error(tmp_path, "model: {preset: tiny}\nparallelism: {tp: 4}\n")
    assert msg.startswith("parallelism.tp: expected a divisor of model.n_kv_heads=2, got 4")


def test_world_size_must_match(tmp_path, monkeypatch):
    from trainer.build import check_world_size

    cfg = load(tmp_path, "parallelism: {tp: 2}\n")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"parallelism: world size 4 \(torchrun\) != tp x pp x dp = 2 x 1 x 1 = 2"):
        check_world_size(cfg)


def test_batch_must_divide(tmp_path):
    msg = error(tmp_path, "train: {global_batch_size: 6, micro_batches: 4}\n")
    assert msg.startswith("train.global_batch_size: expected a multiple of")


def test_pipeline_needs_micro_batches(tmp_path):
    msg = error(tmp_path, "model: {n_layers: 4}\nparallelism: {pp: 4}\ntrain: {micro_batches: 2}\n")
    assert msg == "train.micro_batches: pipeline parallel with pp=4 needs at least 4 micro-batches per step, got 2"


def test_pp_layers_must_sum(tmp_path):
    msg = error(tmp_path, "model: {n_layers: 4}\nparallelism: {pp: 2, pp_layers: [1, 2]}\ntrain: {micro_batches: 2}\n")
    assert "parallelism.pp_layers" in msg and "summing to model.n_layers=4" in msg


def test_bad_values(tmp_path):
    assert error(tmp_path, "mixing: {doremi: {smoothing: 2}}\n").startswith(
        "mixing.doremi.smoothing: expected a value in [0, 1]"
    )
    assert error(tmp_path, "model: {preset: huge}\n").startswith("model.preset: expected one of")
    assert error(tmp_path, "data: {seq_len: 4096}\n").startswith("data.seq_len: expected at most model.max_seq_len")
    assert error(tmp_path, "model: {d_model: 65}\n").startswith("model.d_model: expected a multiple of n_heads")


def test_not_a_mapping(tmp_path):
    assert "expected a mapping" in error(tmp_path, "- 1\n- 2\n")
    assert error(tmp_path, "train: 3\n").startswith("train: expected a mapping, got 3 (int)")


def test_bad_yaml_and_missing_file(tmp_path):
    assert "is not valid YAML" in error(tmp_path, "train: {steps: [\n")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_key_written_twice_is_refused_naming_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section silently dropped the
    first one's keys, so the run trained on values the file did not seem to say."""
    assert error(tmp_path, "train: {steps: 3}\nlogging: {every: 5}\ntrain: {lr: 0.1}\n") == (
        f"{tmp_path / 'c.yaml'}: line 3 is not valid YAML (found key 'train' twice)"
    )
    assert "line 3 is not valid YAML (found key 'lr' twice)" in error(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n")
    assert load(tmp_path, "train: {steps: 3, lr: 0.1}\n").train.lr == 0.1


def test_bad_override_syntax(tmp_path):
    assert "expected KEY.PATH=VALUE" in error(tmp_path, "", "train.steps")


def test_resolved_config_round_trips(tmp_path):
    cfg = load(tmp_path, "model: {preset: tiny}\ntrain: {steps: 7}\n")
    dump_yaml(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml", cls=ExperimentConfig)
    assert again == absolute_paths(cfg)  # paths saved absolute (docs/config.md)
    assert again.data.store_dir == str(Path.cwd() / "runs/stores")


@pytest.mark.parametrize(
    "sets, expect",
    [
        (["logging.every=0"], "logging.every: expected >= 1, got 0"),
        (["train.decay=exponential", "train.min_lr=0"], "train.min_lr: exponential decay needs min_lr > 0, got 0.0"),
        (["train.warmup_steps=-1"], "train.warmup_steps: expected >= 0, got -1"),
        (["checkpoint.keep=-1"], "checkpoint.keep: expected >= 1, got -1"),
        (["checkpoint.every=-5"], "checkpoint.every: expected >= 0"),
        (["train.eval_every=-1"], "train.eval_every: expected >= 0, got -1"),
        (["mixing.doremi.eta=.inf"], "mixing.doremi.eta: expected a finite number, got inf"),
        (["mixing.doremi.eta=-1"], "mixing.doremi.eta: expected a finite value >= 0, got -1.0"),
        (["mixing.doremi.rounds=0"], "mixing.doremi.rounds: expected >= 1, got 0"),
        (
            ["mixing.doremi.mode=resample", "mixing.doremi.reference_cache=c"],
            "mixing.doremi.reference_cache: a cache needs a fixed proxy data stream",
        ),
    ],
)
def test_values_that_would_fail_mid_run_fail_at_load(tmp_path, sets, expect):
    assert expect in error(tmp_path, "", *sets)


def test_yaml_exponent_without_a_dot_is_a_number(tmp_path):
    """PyYAML's YAML 1.1 reads `1e-3` as a string; weights must be numbers, so the loader reads
    YAML 1.2 floats, in files and in --set alike."""
    cfg = load(
        tmp_path, "data: {domain_weights: [1e-3, 1]}\ntrain: {lr: 3e-4}\n", "mixing.doremi.proxy_sampling=[2E+0, 1]"
    )
    assert cfg.data.domain_weights == [0.001, 1.0] and cfg.train.lr == 3e-4
    assert cfg.mixing.doremi.proxy_sampling == [2.0, 1.0]


@pytest.mark.parametrize(
    "sets, expect",
    [
        (
            ["data.domain_weights=[1, true]"],
            "data.domain_weights[1]: expected a number (int or float), got True (bool)",
        ),
        (
            ["mixing.doremi.reference_weights={a: '0.5'}"],
            "mixing.doremi.reference_weights.a: expected a number (int or float), got '0.5' (str)",
        ),
        (
            ["mixing.doremi.proxy_sampling=3"],
            "mixing.doremi.proxy_sampling: expected str or list of number or mapping of str to number, got 3 (int)",
        ),
        (["data.domains=[{name: a, paths: [a.txt]}, 3]"], "data.domains[1]: expected a mapping, got 3 (int)"),
    ],
)
def test_weights_are_numbers_and_errors_name_the_item(tmp_path, sets, expect):
    assert error(tmp_path, "", *sets) == expect
