"""A config that explains itself: `doremi config`, `doremi inspect`, `auto` values, paths
saved absolute, `--set` into lists, `--debug` anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from data.store.store import open_stores
from data.tokenizer.tokenizer import load_tokenizer
from doremi.commands.cli import build_parser, main
from doremi.commands.config_docs import DOCS_PAGE, REGENERATE, experiment_keys, markdown
from doremi.config import ExperimentConfig
from tests import runs
from trainer.config.schema import load_config, require_vocab_size
from trainer.config.tools import ConfigError, apply_overrides, to_dict

EXPERIMENT = """
model: {preset: tiny, vocab_size: 260}
data:
  domains:
    - {name: a, synthetic: {kind: noise, num_tokens: 1000}}
    - {name: b, synthetic: {kind: repeat, num_tokens: 1000}}
  store_dir: stores
  seq_len: 32
train: {steps: 3, global_batch_size: 8, run_dir: runs/x}
"""


@pytest.fixture
def experiment(tmp_path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    return path


def test_set_indexes_lists():
    raw = yaml.safe_load(EXPERIMENT) | {"pipeline": {"main": [{"model": {"preset": "tiny"}}]}}
    apply_overrides(raw, ["data.domains[1].paths=[x.jsonl]", "pipeline.main[0].model.preset=doremi-70m"])
    assert raw["data"]["domains"][1]["paths"] == ["x.jsonl"]
    assert raw["data"]["domains"][0] == {"name": "a", "synthetic": {"kind": "noise", "num_tokens": 1000}}
    assert raw["pipeline"]["main"][0]["model"]["preset"] == "doremi-70m"
    apply_overrides(raw, ["data.domains[-1].name=last"])
    assert raw["data"]["domains"][1]["name"] == "last"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.domains[2].name=c",
            "--set data.domains[2].name=c: data.domains[2]: index out of range (data.domains has 2 entries)",
        ),
        ("data.store_dir[0]=x", "--set data.store_dir[0]=x: data.store_dir is not a list"),
        ("data.domains[x]=1", "--set 'data.domains[x]=1': expected KEY.PATH=VALUE (a key may index a list: a.b[0].c)"),
    ],
)
def test_set_index_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        apply_overrides(yaml.safe_load(EXPERIMENT), [override])
    assert str(e.value) == message


def test_debug_before_or_after_the_command():
    parse = build_parser().parse_args
    assert parse(["--debug", "config", "--keys"]).debug is True
    assert parse(["config", "--keys", "--debug"]).debug is True
    assert parse(["eval", "run", "--debug"]).debug is True
    assert parse(["config", "--keys"]).debug is False


def test_config_prints_the_resolved_config(experiment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", str(experiment), "--set", "train.steps=7", "--set", "model.n_layers=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7
    assert cfg["model"]["n_layers"] == 3
    assert cfg["model"]["d_model"] == 64  # from the preset
    assert cfg["data"]["store_dir"] == str(tmp_path / "stores")  # absolute, as the run saves it
    assert cfg["mixing"]["doremi"]["reference_weights"] == "uniform"  # a name stays a name


def test_config_says_what_it_runs_and_which_inputs_are_missing(tmp_path, capsys):
    qs = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.yaml"
    sets = [f"pipeline.run_dir={tmp_path / 'qs'}", f"data.store_dir={tmp_path / 'stores'}"]
    assert main(["config", str(qs), *(a for s in sets for a in ("--set", s))]) == 0
    said = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert said[0] == "what it runs:"
    assert said[1] == f"preprocess: 6 domains -> {tmp_path / 'stores'} (to build)"
    assert said[2].startswith("round 1: reference: 0.7M params (d_model 96 x 3 layers), 160 steps x 32 x 64")
    assert said[2].endswith(f"-> {tmp_path / 'qs' / 'round1' / 'reference'}")
    assert any(line.startswith("ado: proxy: ") for line in said)
    assert any(line.startswith("main runs (9): doremi, doge, odm, aioli, ado, uniform, tokens, ") for line in said)
    assert said[-1] == "inputs: every file named exists"

    assert main(["config", str(qs), *(a for s in [*sets, "model.vocab_size=auto"] for a in ("--set", s))]) == 0
    said = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert " params besides the embeddings (vocab_size auto: the stores decide)" in said[2]

    assert main(["config", str(qs), *(a for s in [*sets, "train.steps=10"] for a in ("--set", s))]) == 0
    said = capsys.readouterr().out.splitlines()[0]  # Aioli's rounds are shorter than its probes
    assert said.startswith("# what it runs: nothing; `doremi pipeline` would refuse it: pipeline.proxy: mixing.aioli")

    missing = tmp_path / "missing.jsonl"
    sets += [f'data.domains=[{{"name": "a", "paths": ["{missing}"]}}]', "pipeline.methods=[doremi]"]
    assert main(["config", str(qs), *(a for s in sets for a in ("--set", s))]) == 0
    said = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert said[-1] == f"missing input: data.domains[0].paths[0] (a): {missing}"


def test_config_lists_presets_with_sizes(capsys):
    assert main(["config", "--presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "preset",
        "params",
        "vocab",
        "d_model",
        "layers",
        "heads",
        "kv_heads",
        "ffn_dim",
        "max_seq",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["tiny"] == ["tiny", "0.1M", "256", "64", "2", "4", "2", "128", "256"]
    assert rows["llama3-8b"][1] == "8.03B"


def test_config_keys_documents_every_key(capsys):
    keys = experiment_keys()
    assert [k.path for k in keys if not k.doc] == []
    by_path = {k.path: k for k in keys}
    mb = by_path["train.micro_batches"]
    assert (mb.type, mb.default) == ("int", "1")
    assert mb.doc.startswith("Gradient-accumulation steps per optimizer step")
    assert by_path["data.domain_column"].doc.startswith("The column of `dataset`")
    assert by_path["data.domains[].name"].default == "required"
    assert by_path["parallelism.dp"].type == "int or one of 'auto'"
    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    assert "mixing.doremi.average_from_step  (int) = 1\n    `doremi average`: the tuned weights" in out


def test_docs_config_md_is_up_to_date():
    assert REGENERATE in DOCS_PAGE.read_text().splitlines()[2]
    assert DOCS_PAGE.read_text() == markdown(experiment_keys()), f"docs/config.md is stale: run `{REGENERATE}`"


def test_config_without_a_target_is_one_line(capsys):
    assert main(["config"]) == 2
    assert capsys.readouterr().err == "doremi config: error: expected CONFIG, --presets or --keys\n"


def test_dp_auto_is_world_size_over_tp_pp(experiment, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = load_config(experiment, ["parallelism.dp=auto", "parallelism.tp=2"], cls=ExperimentConfig)
    assert cfg.parallelism.dp == 4
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError) as e:
        load_config(experiment, ["parallelism.dp=auto", "parallelism.tp=2"], cls=ExperimentConfig)
    assert str(e.value) == (
        "parallelism.dp: auto needs WORLD_SIZE divisible by tp x pp = 2 x 1, got WORLD_SIZE=3 (or give dp as a number)"
    )
    monkeypatch.delenv("WORLD_SIZE")
    assert load_config(experiment, ["parallelism.dp=auto"], cls=ExperimentConfig).parallelism.dp == 1


def _without_vocab_size(stores: Path, run: Path) -> Path:
    """The test run's config without `model.vocab_size` (nor the preset, which sets one)."""
    path = runs.config_path(stores, run)
    raw = yaml.safe_load(path.read_text())
    del raw["model"]["vocab_size"]
    raw["model"].pop("preset")
    path.write_text(yaml.safe_dump(raw))
    return path


def test_auto_is_the_default_for_vocab_size_and_dp_and_the_start_up_line_says_so(stores, tmp_path, monkeypatch):
    """Issue 43 item 4: a config that omits both gets the stores' vocabulary and WORLD_SIZE over
    tp x pp, each named with its source; without a launcher dp is 1 (the former default), so a
    tp 2 config still loads off the cluster, and nothing is said of it."""
    import dataclasses

    from trainer.config.schema import ModelConfig, ParallelismConfig, auto_notes

    defaults = [{f.name: f.default for f in dataclasses.fields(c)} for c in (ModelConfig, ParallelismConfig)]
    assert (defaults[0]["vocab_size"], defaults[1]["dp"]) == ("auto", "auto")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ParallelismConfig(tp=2).dp == 1  # resolved when the section is made, also in code
    path = _without_vocab_size(stores, tmp_path / "r")
    cfg = load_config(path, ["parallelism.tp=2"], cls=ExperimentConfig)
    assert (cfg.model.vocab_size, cfg.parallelism.dp) == (257, 1)
    assert auto_notes(cfg) == ["vocab_size 257 (auto: from the stores)"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    sets = ["parallelism.tp=2", "parallelism.pp=2", "train.global_batch_size=8", "train.micro_batches=2"]
    cfg = load_config(path, sets, cls=ExperimentConfig)
    assert auto_notes(cfg) == ["vocab_size 257 (auto: from the stores)", "dp 2 (auto: WORLD_SIZE 8 / tp 2 x pp 2)"]
    given = load_config(path, ["model.vocab_size=300", "parallelism.dp=4", "parallelism.tp=2"], cls=ExperimentConfig)
    assert auto_notes(given) == [] and to_dict(given)["model"]["vocab_size"] == 300


def test_the_start_up_line_names_the_vocab_size_auto_chose(stores, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _without_vocab_size(stores, tmp_path / "r")
    assert main(["train", str(path), "--set", "train.steps=1", "--set", "train.eval_every=0"]) == 0
    start = capsys.readouterr().err.splitlines()[1]
    assert start.startswith("device cpu, ") and start.endswith("M parameters, vocab_size 257 (auto: from the stores)")


def test_vocab_size_auto_from_the_stores(stores, tmp_path):
    cfg = load_config(runs.config_path(stores, tmp_path / "r"), ["model.vocab_size=auto"], cls=ExperimentConfig)
    assert cfg.model.vocab_size == 257  # the byte tokenizer: 256 bytes and EOS
    assert require_vocab_size(cfg) == 257


def test_vocab_size_auto_without_stores_is_one_line(experiment, tmp_path):
    cfg = load_config(experiment, ["model.vocab_size=auto", f"data.store_dir={tmp_path}/none"], cls=ExperimentConfig)
    assert cfg.model.vocab_size == "auto"  # preprocess and the pipeline's checks still load it
    with pytest.raises(ConfigError) as e:
        require_vocab_size(cfg)
    assert str(e.value) == (
        f"model.vocab_size: auto takes the tokenizer's vocabulary from the token stores, but "
        f"{tmp_path}/none/manifest.json does not exist; run `doremi preprocess` first or give a number"
    )


def test_run_saves_absolute_paths_and_evaluates_from_elsewhere(stores, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    os.symlink(stores, work / "data" / "stores")
    monkeypatch.chdir(work)
    path = runs.config_path(Path("data/stores"), Path("runs/r"))
    assert main(["train", str(path), "--set", "train.steps=1", "--set", "train.eval_every=0"]) == 0
    saved = yaml.safe_load((work / "runs/r/config.yaml").read_text())
    assert saved["data"]["store_dir"] == str(work / "data/stores")
    assert saved["train"]["run_dir"] == str(work / "runs/r")
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(work / "runs/r")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == ["domain", "noise", "easy", "markov", "average", "worst"]


def test_inspect_prints_the_manifest_and_decoded_documents(stores, capsys):
    assert main(["inspect", str(stores), "--domain", "easy", "-n", "1"]) == 0
    full = capsys.readouterr().out
    out = full.split("\n")
    assert out[0] == f"stores: {stores}"
    assert out[1].startswith("tokenizer: byte (vocab_size 257, eos_id 256)")
    assert out[2].split() == "domain train docs train tokens train bytes val docs val tokens val bytes".split()
    assert [line.split()[0] for line in out[3:6]] == ["noise", "easy", "markov"]
    assert out[7].startswith("== easy: 1 of ")
    doc = open_stores(stores).document("easy", "train", 0)
    text = load_tokenizer(stores).decode(int(t) for t in doc)
    assert full.endswith(f"-- [0] {len(doc)} tokens\n{text[:400]} [...]\n")


def test_counts_table_fits_100_columns_with_bytes_per_split():
    from types import SimpleNamespace

    from data.store.store import DomainEntry, SplitCounts
    from doremi.commands.inspect import counts_table

    long = "a-domain-name-longer-than-the-table-allows"
    domains = [
        DomainEntry(long, "files", SplitCounts(10**12, 10**9, 4 * 10**12), SplitCounts(10**9, 10**6, 999_990_000)),
        DomainEntry("markov", "synthetic", SplitCounts(6000, 30), SplitCounts(600, 3)),
    ]
    lines = counts_table(SimpleNamespace(domains=domains, domain_names=[d.name for d in domains]))
    assert max(len(line) for line in lines) == 100
    assert lines[1].split() == [long[:25] + "~", "1000000000", "1000000000000", "4000.00", "GB"] + [
        "1000000",
        "1000000000",
        "999.99",
        "MB",
    ]
    assert lines[2].split() == ["markov", "30", "6000", "-", "3", "600", "-"]


def test_inspect_without_stores_is_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"doremi inspect: error: {tmp_path}/manifest.json: no token stores here; build them with `doremi preprocess`\n"
    )


def test_inspect_of_nothing_says_what_it_expected(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (
        f"doremi inspect: error: {tmp_path / 'nope'}: not found (expected stores, a run directory or a config file)\n"
    )


def test_inspect_a_config_reads_its_store_dir(stores, tmp_path, capsys):
    path = runs.config_path(stores, tmp_path / "r")
    assert main(["inspect", str(path), "-n", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"stores: {stores}"
    assert len(out) == 6  # the summary only: stores, tokenizer, header, three domains


def test_inspect_a_run_directory_follows_its_stores(stores, tmp_path, capsys):
    from doremi.pipeline import stages

    run = tmp_path / "run"
    stages.train(runs.config(stores, run, "train.steps=1"))
    capsys.readouterr()
    assert main(["inspect", str(run), "-n", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"stores: {stores}"


def test_plan_with_vocab_size_auto_before_the_stores_is_one_line(tmp_path, capsys):
    from doremi.commands.cli import main

    cfg = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "own_data.yaml"
    assert (
        main(["plan", str(cfg), "--gpus", "1", "--gpu-memory", "80", "--set", f"data.store_dir={tmp_path / 'none'}"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("doremi plan: error: model.vocab_size: auto takes the tokenizer's")
