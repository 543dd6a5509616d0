"""Which `model` config keys decide the function a model's parameters compute: the one list a
checkpoint is checked against on load (`trainer.checkpoint.checkpoint`) and a Hugging Face model against on
import (`trainer.hf.init`). Two configs with equal `architecture` compute the same function of
the same parameters; every other key (initialisation, attention kernel, compile, the RoPE
table's length, the Mamba chunk size, FP8, the MoE loss coefficients) may change on resume.

A key that changes the function without changing a tensor's shape (head counts, top-k, the
gating, muP's base width) is the case this guards: the parameters load, and the run computes
something else with exit status 0."""

from __future__ import annotations

from typing import Any

#: The `model` keys of a dense Llama.
ARCH_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
)

#: The `model.mamba` keys of the Mamba-2 layers (trainer.model.mamba.mixer).
MAMBA_ARCH_KEYS = ("d_state", "d_conv", "expand", "head_dim", "ngroups")

#: The `model.moe` keys of the routed MLPs (trainer.model.moe); `expert_ffn_dim` and `layers`
#: are compared resolved (None: the model's ffn_dim; empty: every block).
MOE_ARCH_KEYS = ("num_experts", "top_k", "shared_experts", "gating", "normalize_top_k")


def _mamba(model: dict[str, Any]) -> dict[str, Any]:
    pattern = model.get("block_pattern") or ""
    if "M" not in pattern:
        return {}
    mamba = model.get("mamba") or {}
    return {"block_pattern": pattern, **{f"mamba.{k}": mamba.get(k) for k in MAMBA_ARCH_KEYS}}


def _moe(model: dict[str, Any]) -> dict[str, Any]:
    moe = model.get("moe")
    if not moe:
        return {}
    n_layers = model.get("n_layers")
    layers = sorted(moe.get("layers") or []) or list(range(n_layers if isinstance(n_layers, int) else 0))
    return {
        **{f"moe.{k}": moe.get(k) for k in MOE_ARCH_KEYS},
        "moe.expert_ffn_dim": moe.get("expert_ffn_dim") or model.get("ffn_dim"),
        "moe.layers": layers,
    }


def _mup(model: dict[str, Any]) -> dict[str, Any]:
    mup = model.get("mup")
    return {"mup.base_width": mup.get("base_width")} if mup else {}


def architecture(model: dict[str, Any]) -> dict[str, Any]:
    """A model config (`dataclasses.asdict` of `ModelConfig`, as saved in a checkpoint) reduced
    to its architecture keys, flattened (`n_heads`, `moe.top_k`, `mamba.d_state`, ...). The
    optional parts are empty for a model without them, so that checkpoints written before those
    keys existed still compare equal."""
    return {**{k: model.get(k) for k in ARCH_KEYS}, **_mamba(model), **_moe(model), **_mup(model)}


def architecture_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for each architecture key that differs, in a stable order."""
    was, now = architecture(saved), architecture(current)
    keys = list(was) + [k for k in now if k not in was]
    return [(k, was.get(k), now.get(k)) for k in keys if was.get(k) != now.get(k)]
