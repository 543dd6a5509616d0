"""Stores and stages that stay put (issue 27): `preprocess` does not replace stores built from
other inputs without `--force`; checkpoints remember the stores they were trained on and are not
evaluated, resumed or used as a reference on others; a pipeline rerun redoes only the stages
whose keys changed, says which, and keeps the results it replaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.atomic import atomic_write_text
from data.preprocess.preprocess import changed_inputs, preprocess
from data.store.store import read_manifest
from doremi.commands.cli import main
from doremi.config import ExperimentConfig
from doremi.pipeline import stages
from trainer.checkpoint.checkpoint import CheckpointError, latest_checkpoint
from trainer.config.schema import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT_YAML = """
model: {{preset: tiny, vocab_size: 384, n_layers: 2, d_model: 32, n_heads: 2, n_kv_heads: 2, ffn_dim: 64}}
data:
  domains:
    - {{name: code, embedded: code, max_documents: 40}}
    - {{name: notes, embedded: notes, max_documents: 40}}
  tokenizer: {{kind: bpe, vocab_size: 300, train_max_bytes: 20000}}
  store_dir: {store}
  seq_len: 32
  validation_fraction: 0.2
train: {{steps: 2, global_batch_size: 4, micro_batches: 1, lr: 3.0e-3, warmup_steps: 0, decay: constant,
        run_dir: {run}, eval_sequences: 4}}
logging: {{progress: false}}
checkpoint: {{every: 1}}
"""


def text_config(tmp_path: Path, *sets: str) -> tuple[Path, ExperimentConfig]:
    path = tmp_path / "exp.yaml"
    atomic_write_text(path, TEXT_YAML.format(store=tmp_path / "stores", run=tmp_path / "run"))
    return path, load_config(path, list(sets), cls=ExperimentConfig)


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_changed_inputs_name_the_parts():
    old = {"version": 1, "domains": [["a", "x"], ["b", "y"]], "tokenizer": "byte", "split": [0.1, 0]}
    new = {"version": 1, "domains": [["a", "z"], ["c", "w"]], "tokenizer": ["bpe", 300], "split": [0.1, 0]}
    assert changed_inputs(old, new) == ["tokenizer", "domain 'b' removed", "domain 'a' source", "domain 'c' added"]
    assert changed_inputs({}, new)[0].startswith("unknown (")


def test_rebuilt_tokenizer_is_refused_then_forced_and_the_old_run_is_not_evaluated_on_it(tmp_path, capsys):
    path, cfg = text_config(tmp_path)
    preprocess(cfg.data, progress=False)
    stages.train(cfg)
    run = tmp_path / "run"
    meta = json.loads((latest_checkpoint(run) / "meta.json").read_text())
    built = read_manifest(cfg.data.store_dir)
    assert meta["data"] == {"fingerprint": built.fingerprint, "tokenizer": built.tokenizer}
    domains, before = stages.evaluate(run)
    assert domains == ["code", "notes"]

    # One changed tokenizer key: refused, nothing touched, the run still evaluates the same.
    store_bytes = file_bytes(tmp_path / "stores")
    change = ["--set", "data.tokenizer.vocab_size=320"]
    capsys.readouterr()
    assert main(["preprocess", str(path), *change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "holds stores built from other inputs (changed: tokenizer;" in err[0]
    assert "use another data.store_dir, or `doremi preprocess CONFIG --force` to replace them" in err[0]
    assert file_bytes(tmp_path / "stores") == store_bytes
    assert stages.evaluate(run)[1].tolist() == before.tolist()

    # --force replaces them; the run trained on the old ones is then refused, not scored.
    assert main(["preprocess", str(path), *change, "--force"]) == 0
    rebuilt = read_manifest(cfg.data.store_dir)
    assert rebuilt.fingerprint != built.fingerprint and rebuilt.tokenizer["vocab_size"] == 320
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"doremi eval: error: {run}: trained on stores {built.fingerprint[:12]} (tokenizer "
        f"{built.tokenizer['name']} {built.tokenizer['hash'][:12]}), but the stores it would read now are "
        f"{rebuilt.fingerprint[:12]} (tokenizer {rebuilt.tokenizer['name']} {rebuilt.tokenizer['hash'][:12]}); "
        f"point data.store_dir at the stores it was trained on, or train it again"
    ]

    # Resuming it, or using it as a proxy's reference, is refused the same way.
    _, longer = text_config(tmp_path, "train.steps=3", "data.tokenizer.vocab_size=320")
    with pytest.raises(CheckpointError, match=f"{run}: trained on stores {built.fingerprint[:12]} "):
        stages.train(longer)
    _, proxy = text_config(
        tmp_path,
        f"train.run_dir={tmp_path / 'proxy'}",
        f"mixing.doremi.reference={run}",
        "data.tokenizer.vocab_size=320",
    )
    with pytest.raises(CheckpointError, match=f"{run}: trained on stores {built.fingerprint[:12]} "):
        stages.train_proxy(proxy)


# -- the pipeline: stages fingerprinted over the keys they read; replaced results kept ------------


def sweep_point(stores: Path, tmp_path: Path, eta: float) -> tuple[Path, list[str]]:
    from tests.runs import pipeline_messages

    root = tmp_path / "sweep"
    sets = [
        "train.steps=3",
        "train.decay=constant",
        "train.warmup_steps=0",
        "checkpoint.every=3",
        "pipeline.baselines=[uniform]",
        f"mixing.doremi.eta={eta}",
    ]
    return root, pipeline_messages(stores, tmp_path, root, sets)


def said(messages: list[str], start: str) -> list[str]:
    """The messages of one stage, without their elapsed-time prefix."""
    return [m.split("] ", 1)[1] for m in messages if m.split("] ", 1)[-1].startswith(start)]


def test_new_eta_redoes_only_the_proxy_and_what_reads_it_and_keeps_the_previous_point(stores, tmp_path):
    from doremi.outputs.stage_markers import read_marker

    root, _ = sweep_point(stores, tmp_path, 1.0)
    first = {
        "proxy": read_marker(root / "round1" / "proxy" / "stage.json"),
        "weights": (root / "round1" / "weights.json").read_bytes(),
        "average": read_marker(root / "round1" / "weights.json.stage.json"),
        "doremi": read_marker(root / "main" / "doremi" / "stage.json"),
        "metrics": (root / "main" / "doremi" / "metrics.jsonl").read_bytes(),
        "eval": read_marker(root / "main" / "doremi" / "eval.json.stage.json")["result"],
    }
    reference = (root / "round1" / "reference" / "metrics.jsonl").read_bytes()
    uniform = (root / "main" / "uniform" / "metrics.jsonl").read_bytes()

    root, messages = sweep_point(stores, tmp_path, 3.0)
    assert said(messages, "round 1: reference:") == [
        f"round 1: reference: done already ({root / 'round1' / 'reference'}), skipped"
    ]
    assert said(messages, "main run: uniform:") == [
        f"main run: uniform: done already ({root / 'main' / 'uniform'}), skipped"
    ]
    assert said(messages, "eval: uniform:") == [
        f"eval: uniform: done already ({root / 'main' / 'uniform' / 'eval.json'}), skipped"
    ]
    kept_proxy = root / "previous" / "round1" / f"proxy.{first['proxy']['fingerprint']}"
    assert said(messages, "round 1: proxy:") == [
        f"round 1: proxy: redone, config changed: doremi.eta 1.0 -> 3.0; the previous output is kept in {kept_proxy}"
    ]
    kept_weights = root / "previous" / "round1" / f"weights.{first['average']['fingerprint']}.json"
    assert said(messages, "round 1: average:") == [
        f"round 1: average: redone, config changed: doremi.eta 1.0 -> 3.0; the previous output is kept in {kept_weights}"
    ]
    (doremi_line,) = said(messages, "main run: doremi:")
    kept_main = root / "previous" / "main" / f"doremi.{first['doremi']['fingerprint']}"
    assert doremi_line.startswith("main run: doremi: redone, config changed: data.domain_weights (content) ")
    assert doremi_line.endswith(f"; the previous output is kept in {kept_main}")
    assert said(messages, "eval: doremi:") == []  # its marker moved with its run

    assert (root / "round1" / "reference" / "metrics.jsonl").read_bytes() == reference
    assert (root / "main" / "uniform" / "metrics.jsonl").read_bytes() == uniform
    assert read_marker(kept_proxy / "stage.json") == first["proxy"]
    assert kept_weights.read_bytes() == first["weights"] != (root / "round1" / "weights.json").read_bytes()
    assert read_marker(kept_weights.with_name(kept_weights.name + ".stage.json")) == first["average"]
    assert (kept_main / "metrics.jsonl").read_bytes() == first["metrics"]
    assert read_marker(kept_main / "eval.json.stage.json")["result"] == first["eval"]
    assert not (kept_main / ".lock").exists()
    assert read_marker(root / "round1" / "proxy" / "stage.json")["keys"]["doremi.eta"] == 3.0


def test_stage_keys_are_the_keys_each_stage_reads(stores, tmp_path):
    from doremi.outputs.fingerprint import MAIN_IGNORES, REFERENCE_IGNORES, REFERENCE_READS, stage_keys
    from tests.runs import config

    cfg = config(stores, tmp_path / "run", "mixing.doremi.eta=3.0", "mixing.doremi.reference_weights=tokens")
    reference = stage_keys(cfg, REFERENCE_IGNORES, REFERENCE_READS)
    main_run = stage_keys(cfg, MAIN_IGNORES)
    proxy = stage_keys(cfg)
    assert [k for k in reference if k.startswith("doremi.")] == ["doremi.reference_weights"]
    assert [k for k in main_run if k.startswith("doremi.")] == []
    assert proxy["doremi.eta"] == 3.0 and "doremi.rounds" not in proxy and "train.run_dir" not in proxy
    assert not any(k.startswith(("logging.", "pipeline.")) for k in proxy)
    assert reference["data (stores)"] == main_run["data (stores)"] == read_manifest(stores).fingerprint[:16]
