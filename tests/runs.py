"""Small end-to-end runs for tests: token stores of synthetic domains, configs of a tiny Llama,
and trainer runs in one process or spread over gloo processes (tests/distributed.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from data.atomic import atomic_write_text
from doremi.config import ExperimentConfig
from trainer.config.schema import load_config
from trainer.records.metrics import read_jsonl

STORE_YAML = """
model: {{preset: tiny, vocab_size: 260, n_layers: 4, d_model: 64, n_heads: 4, n_kv_heads: 2, ffn_dim: 128}}
data:
  domains:
    - {{name: noise, synthetic: {{kind: noise, num_tokens: 30000, vocab: 64, seed: 1}}}}
    - {{name: easy, synthetic: {{kind: repeat, num_tokens: 30000, vocab: 64, seed: 2}}}}
    - {{name: markov, synthetic: {{kind: markov, num_tokens: 60000, vocab: 64, order: 2, branching: 4, seed: 3}}}}
  store_dir: {store}
  seq_len: 32
  validation_fraction: 0.1
train: {{steps: 3, global_batch_size: 8, micro_batches: 1, lr: 3.0e-3, warmup_steps: 1, grad_clip: 1.0,
        run_dir: {run}, eval_sequences: 16}}
logging: {{progress: false}}
checkpoint: {{resume: true}}
"""


def config_path(store: Path, run: Path, template: str = STORE_YAML) -> Path:
    """The experiment YAML of a test run, `template` with its store and run directories, written
    beside its run directory."""
    path = Path(str(run) + ".yaml")
    atomic_write_text(path, template.format(store=store, run=run))
    return path


def config(store: Path, run: Path, *sets: str, template: str = STORE_YAML) -> ExperimentConfig:
    return load_config(config_path(store, run, template), list(sets), cls=ExperimentConfig)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def alphas(run: Path) -> list[list[float]]:
    return [r["weights"] for r in read_jsonl(Path(run) / "domain_weights.jsonl")]


def val_losses(run: Path) -> list[float]:
    """The one validation row's per-domain losses."""
    rows = [r for r in read_jsonl(Path(run) / "metrics.jsonl") if "val_loss" in r]
    assert len(rows) == 1
    return list(rows[0]["val_loss"].values())


def single_process_runs(store: Path, root: Path, sets: list[str], proxy_sets: list[str]) -> list[str]:
    """The single-process runs a layout test compares its layouts against, under `root`: `single`
    (the config's steps), `single-4steps`, a `reference` and the proxy `proxy-single` on it (with
    `proxy_sets` added). Returns the proxy's --set list, for the layouts' proxies."""
    from doremi.pipeline import stages

    stages.train(config(store, root / "single", *sets))
    stages.train(config(store, root / "single-4steps", *sets, "train.steps=4"))
    stages.train_reference(config(store, root / "reference", *sets))
    proxy = [*sets, *proxy_sets, f"mixing.doremi.reference={root / 'reference'}"]
    stages.train_proxy(config(store, root / "proxy-single", *proxy))
    return proxy


def final_params(store: Path, run: Path, *model_sets: str) -> dict[str, torch.Tensor]:
    """Parameters of a run's last checkpoint, reassembled into a single-process model of the
    default test config with `model_sets` (the run's architecture keys: the load checks them)."""
    from trainer.build import build_model
    from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint
    from trainer.parallel.context import ParallelContext

    cfg = config(store, Path(str(run) + "-load"), *model_sets)
    model = build_model(cfg, ParallelContext.single())
    load_checkpoint(latest_checkpoint(run), model, None, ParallelContext.single())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_stage(rank: int, world: int, stage: str, store: str, jobs: list[tuple[str, list[str]]]) -> None:
    """Worker: run `stage` (train / train-proxy) for each (run_dir, --set list) in turn."""
    from doremi.pipeline import stages

    for run, sets in jobs:
        cfg = config(Path(store), Path(run), *sets)
        {"train": stages.train, "train-proxy": stages.train_proxy, "train-reference": stages.train_reference}[stage](
            cfg
        )


def pipeline_messages(stores: Path, tmp_path: Path, root: Path, sets: list[str]) -> list[str]:
    """Run `doremi pipeline` in process on the test experiment (its file under tmp_path) into
    `root` on `stores`, with `sets`; the messages it said."""
    from doremi.pipeline.pipeline import Pipeline

    messages: list[str] = []
    overrides = [*sets, f"pipeline.run_dir={root}", f"data.store_dir={stores}"]
    Pipeline(config_path(stores, tmp_path / "exp"), overrides, say=messages.append).run()
    return messages
