"""`doremi config`: what a config will run and the resolved config as YAML, the model
presets, or every key's doc.

A researcher reads what a run will do before it runs: first the stages and runs `doremi
pipeline` (or a stage command) will make, each with its model, steps, tokens and directory, and
the inputs that are missing; then the YAML that the run's config.yaml will hold (presets merged,
`--set` applied, `auto` resolved where it can be, paths absolute). The overview is YAML comments,
so the whole output still loads as the config.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from doremi.config import ExperimentConfig
from trainer.config.moe import moe_params_delta
from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, load_config
from trainer.config.tools import absolute_paths, from_dict, read_yaml, to_dict
from trainer.model.flops import blocks_params, param_count


def resolved_yaml(path: str, overrides: list[str]) -> str:
    cfg = load_config(path, overrides, cls=ExperimentConfig)
    return yaml.safe_dump(to_dict(absolute_paths(cfg)), sort_keys=False)


def _run_words(cfg: ExperimentConfig) -> str:
    m, t = cfg.model, cfg.train
    tokens = t.steps * t.global_batch_size * cfg.data.seq_len
    params = (
        f"{_size(blocks_params(m) + m.d_model + moe_params_delta(m, False))} params besides the embeddings "
        "(vocab_size auto: the stores decide)"
        if m.vocab_size == "auto"
        else f"{_size(param_count(m))} params"
    )
    return (
        f"{params} (d_model {m.d_model} x {m.n_layers} layers), {t.steps} steps x "
        f"{t.global_batch_size} x {cfg.data.seq_len} = {tokens / 1e6:.3g}M tokens"
    )


def stage_overview(path: str, overrides: list[str]) -> list[str]:
    """What `doremi pipeline CONFIG` runs, stage by stage (a plain config: its one run), and each
    input that does not exist yet, as lines."""
    from doremi.config import OFFLINE_METHODS
    from doremi.outputs.main_runs import REFERENCE_RUN, main_run_name, online_run_name, search_dir
    from doremi.pipeline.pipeline import Pipeline

    cfg = load_config(path, overrides, cls=ExperimentConfig)
    out = []
    stores = Path(cfg.data.store_dir)
    built = (stores / "manifest.json").is_file()
    out.append(
        f"preprocess: {len(cfg.data.domains) or 'column'} domains -> {stores} ({'built' if built else 'to build'})"
    )
    missing = missing_inputs(cfg)
    raw = read_yaml(path)
    if REFERENCE_RUN not in (raw.get("mixing") or {}) and "pipeline" not in raw:
        out.append(f"train: {_run_words(cfg)} -> {cfg.train.run_dir or 'runs/<config>/train'}")
    else:
        pipe = Pipeline(path, overrides, say=lambda m: None)
        p, root = pipe.p, pipe.root
        proxy = pipe.stage_config(p.proxy)
        main = pipe.stage_config(p.main)
        searches = range(1, p.searches + 1)
        if REFERENCE_RUN in p.methods:
            for r in range(1, getattr(proxy.mixing, REFERENCE_RUN).rounds + 1):
                for i in searches:
                    where = search_dir(root / f"round{r}", i, p.searches)
                    label = f"round {r}" + (f", search {i}" if p.searches > 1 else "")
                    for stage in ("reference", "proxy"):
                        out.append(f"{label}: {stage}: {_run_words(proxy)} -> {where / stage}")
        for m in p.methods:
            if m != REFERENCE_RUN and m not in OFFLINE_METHODS:
                for i in searches:
                    where = search_dir(root / "methods" / m, i, p.searches)
                    label = f"{m}: proxy" + (f" (search {i})" if p.searches > 1 else "")
                    out.append(f"{label}: {_run_words(proxy)} -> {where / 'proxy'}")
        offline = [m for m in p.methods if m in OFFLINE_METHODS]
        if offline:
            out.append(f"sweep: {proxy.sweep.runs} small runs for {', '.join(offline)} -> {root / 'sweep'}")
        if not p.skip_main:
            names = list(p.methods)
            names += [online_run_name(m) for m in p.online] + [main_run_name(b) for b in p.baselines]
            out.append(f"main runs ({len(names)}): {', '.join(names)}: {_run_words(main)} each -> {root / 'main'}")
        out.append(f"report: {root / 'report.md'}")
    out += [f"missing input: {m}" for m in missing] or ["inputs: every file named exists"]
    return out


def missing_inputs(cfg: ExperimentConfig) -> list[str]:
    """Each local file a config names that does not exist (a domain's paths, the dataset files,
    a tokenizer file, a weights file), with its key."""
    import glob

    out = []
    for i, d in enumerate(cfg.data.domains):
        for j, p in enumerate(d.paths):
            if not glob.glob(str(p)):
                out.append(f"data.domains[{i}].paths[{j}] ({d.name}): {p}")
    for j, p in enumerate(cfg.data.dataset):
        if not glob.glob(str(p)):
            out.append(f"data.dataset[{j}]: {p}")
    tok = cfg.data.tokenizer
    if tok.kind == "file" and tok.path and not Path(tok.path).exists():
        out.append(f"data.tokenizer.path: {tok.path}")
    w = cfg.data.domain_weights
    if isinstance(w, str) and w.endswith(".json") and not Path(w).exists():
        out.append(f"data.domain_weights: {w}")
    return out


def _size(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_presets() -> str:
    """One line per preset: its parameter count (tied embeddings counted once) and shape."""
    head = ("preset", "params", "vocab", "d_model", "layers", "heads", "kv_heads", "ffn_dim", "max_seq")
    shape_keys = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
    rows = []
    for name, shape in PRESETS.items():
        m = from_dict(ModelConfig, dict(shape), f"model (preset {name})")
        rows.append((name, _size(param_count(m)), *(getattr(m, k) for k in shape_keys)))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows]) + "\n"
