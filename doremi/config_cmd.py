"""`doremi config`: the resolved config as YAML, the model presets, or every key's doc.

A researcher reads what a run will do before it runs: the YAML printed is what the run's
config.yaml will hold (presets merged, `--set` applied, `auto` resolved where it can be, paths
absolute).
"""

from __future__ import annotations

import yaml

from doremi.config import ExperimentConfig
from trainer.config import ModelConfig, load_config
from trainer.configtools import absolute_paths, from_dict, to_dict
from trainer.model.flops import param_count
from trainer.model.presets import PRESETS


def resolved_yaml(path: str, overrides: list[str]) -> str:
    cfg = load_config(path, overrides, cls=ExperimentConfig)
    return yaml.safe_dump(to_dict(absolute_paths(cfg)), sort_keys=False)


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
