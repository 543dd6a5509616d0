"""The Hugging Face Llama format (`transformers` `LlamaForCausalLM`), mapped to and from ours.

Pure functions, no I/O and no `transformers`: parameter names and tensors (`to_hf_state`,
`our_tensor`), and the model config (`to_hf_config`, `model_keys_from_hf`). The format is
transformers' `LlamaConfig` (config.json) and `modeling_llama.py` (parameter names); the
files are written and read by `trainer.hf.files`.

What maps, and how:
- names: `HF_NAMES` (one table); our fused projections are split on the way out and
  concatenated on the way in: `attn.qkv` = [q_proj | k_proj | v_proj] (rows), `mlp.gate_up` =
  [gate_proj | up_proj];
- RoPE: both use the rotate-half convention (`trainer.model.ops.rope.rotate`: the first and second
  halves of each head dimension are a pair), so q and k rows are copied as they are. (Meta's
  original checkpoints pair adjacent dimensions, which is why transformers' Meta->HF conversion
  script permutes the q and k rows; ours need no permutation.) Llama-3 frequency scaling is
  `rope_scaling` with `rope_type: llama3`;
- vocabulary: ours is padded for tensor parallelism (`trainer.parallel.tensor.padded_vocab_size`,
  zero rows that no output reads); the padding is trimmed on the way out and zeros are added back
  on the way in;
- tied embeddings: HF keeps `lm_head.weight` out of the files (`tie_word_embeddings`); an untied
  head is `head.weight` <-> `lm_head.weight`.

What does not map is one `HFFormatError` line: another architecture, biases, another
activation, a head dimension other than hidden_size / num_attention_heads, another RoPE type;
and on our side, a model that is not the plain Llama (`check_plain_llama`: MoE MLPs, Mamba-2
mixers, muP multipliers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from data.errors import UserError

#: Our parameter name -> its HF names (several: the parts of a fused projection, in row order).
#: `{i}` is the layer index.
HF_NAMES: dict[str, tuple[str, ...]] = {
    "embed.weight": ("model.embed_tokens.weight",),
    "layers.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight",),
    "layers.{i}.attn.qkv.weight": (
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ),
    "layers.{i}.attn.out.weight": ("model.layers.{i}.self_attn.o_proj.weight",),
    "layers.{i}.mlp_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "layers.{i}.mlp.gate_up.weight": (
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
    ),
    "layers.{i}.mlp.down.weight": ("model.layers.{i}.mlp.down_proj.weight",),
    "norm.weight": ("model.norm.weight",),
    "head.weight": ("lm_head.weight",),
}

_VOCAB = ("embed.weight", "head.weight")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFFormatError(UserError, ValueError):
    """A Hugging Face directory or config that does not map onto this framework's Llama."""


def _template(name: str) -> tuple[str, int | None]:
    """`layers.3.attn.out.weight` -> (`layers.{i}.attn.out.weight`, 3); others (name, None)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit():
        return ".".join(["layers", "{i}", *parts[2:]]), int(parts[1])
    return name, None


def hf_names(name: str) -> tuple[str, ...]:
    """The HF tensors that our parameter `name` is made of."""
    template, layer = _template(name)
    if template not in HF_NAMES:
        raise HFFormatError(f"parameter {name!r} has no Hugging Face Llama counterpart")
    return tuple(n.format(i=layer) for n in HF_NAMES[template])


def split_sizes(name: str, cfg: Any) -> list[int]:
    """Row counts of the HF parts of our parameter `name` (one part for unfused ones)."""
    template, _ = _template(name)
    if template.endswith("attn.qkv.weight"):
        return [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    if template.endswith("mlp.gate_up.weight"):
        return [cfg.ffn_dim, cfg.ffn_dim]
    return []


def check_plain_llama(cfg: Any, what: str) -> None:
    """One line when model config `cfg` is not the plain Llama that transformers'
    `LlamaForCausalLM` computes: its MoE MLPs and Mamba-2 mixers have no Llama tensors, and
    muP's logit and attention multipliers change the function of the same tensors (so a muP
    model would load and compute something else, silently)."""
    if getattr(cfg, "moe", None) is not None:
        raise HFFormatError(f"model.moe: {what} maps the plain Llama only, not mixture-of-experts MLPs")
    if "M" in (getattr(cfg, "block_pattern", "") or ""):
        raise HFFormatError(
            f"model.block_pattern: {what} maps the plain Llama only, not Mamba-2 layers, got {cfg.block_pattern!r}"
        )
    if getattr(cfg, "mup", None) is not None:
        raise HFFormatError(
            f"model.mup: {what} maps the plain Llama only, without muP's logit and attention multipliers"
        )


def hf_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of the model of `cfg` (unpadded vocabulary; no `lm_head`
    when tied), as transformers' `LlamaForCausalLM` holds them."""
    d, hd = cfg.d_model, cfg.head_dim
    full = {
        "embed.weight": (cfg.vocab_size, d),
        "head.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "attn_norm.weight": (d,),
        "mlp_norm.weight": (d,),
        "attn.qkv.weight": ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, d),
        "attn.out.weight": (d, cfg.n_heads * hd),
        "mlp.gate_up.weight": (2 * cfg.ffn_dim, d),
        "mlp.down.weight": (d, cfg.ffn_dim),
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in our_names(cfg):
        rows, *rest = full[_template(name)[0].removeprefix("layers.{i}.")]
        sizes = split_sizes(name, cfg) or [rows]
        for hf, part in zip(hf_names(name), sizes, strict=True):
            out[hf] = (part, *rest)
    return out


def our_names(cfg: Any) -> list[str]:
    """Every parameter name of the single-process model of `cfg`."""
    layer = [t for t in HF_NAMES if t.startswith("layers.")]
    names = ["embed.weight", *(t.format(i=i) for i in range(cfg.n_layers) for t in layer), "norm.weight"]
    return names + ([] if cfg.tie_embeddings else ["head.weight"])


def to_hf_state(state: dict[str, torch.Tensor], cfg: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our single-process parameters -> HF tensors (own, contiguous memory; `dtype`: cast to it):
    fused projections split, the vocabulary padding trimmed, a tied head left out."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = value.detach()
        if name in _VOCAB:
            value = value[: cfg.vocab_size]
        sizes = split_sizes(name, cfg)
        parts = value.split(sizes, dim=0) if sizes else (value,)
        for hf, part in zip(hf_names(name), parts, strict=True):
            out[hf] = part.to(dtype or part.dtype).contiguous().clone()
    return out


def our_tensor(name: str, get: Callable[[str], torch.Tensor], cfg: Any, rows: int | None = None) -> torch.Tensor:
    """Our full (single-process) parameter `name` from the HF tensors `get(hf_name)` returns:
    fused parts concatenated; a vocabulary matrix padded with zero rows to `rows` (its padded
    size under the target layout). Shapes are checked against `cfg`."""
    parts = [get(n) for n in hf_names(name)]
    sizes = split_sizes(name, cfg)
    for hf, part, want in zip(hf_names(name), parts, sizes or [None]):
        if want is not None and part.shape[0] != want:
            raise HFFormatError(f"{hf}: expected {want} rows, got shape {tuple(part.shape)}")
    value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
    if name in _VOCAB:
        if value.shape[0] != cfg.vocab_size:
            raise HFFormatError(
                f"{hf_names(name)[0]}: expected {cfg.vocab_size} rows (vocab_size), got {value.shape[0]}"
            )
        if rows is not None and rows > value.shape[0]:
            value = torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])])
    return value


def from_hf_state(hf: dict[str, torch.Tensor], cfg: Any, rows: int | None = None) -> dict[str, torch.Tensor]:
    """HF tensors -> our single-process parameters (`our_tensor` for each of `our_names`)."""

    def get(n: str) -> torch.Tensor:
        if n not in hf:
            raise HFFormatError(f"no tensor {n!r} in the Hugging Face weights")
        return hf[n]

    return {n: our_tensor(n, get, cfg, rows) for n in our_names(cfg)}


# -- config ---------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_hf_config(cfg: Any, dtype: torch.dtype, eos_id: int | None) -> dict[str, Any]:
    """transformers' LlamaConfig (config.json) of our model config. RoPE is written both as
    `rope_theta`/`rope_scaling` (transformers 4) and `rope_parameters` (transformers 5)."""
    check_plain_llama(cfg, "a Llama config.json")
    scaling = cfg.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    legacy = None
    if scaling is not None:
        legacy = {
            "rope_type": "llama3",
            "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position),
        }
        rope = {**legacy, "rope_theta": float(cfg.rope_theta)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": legacy,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def _rope_keys(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` from either transformers 4 or 5 keys."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFFormatError(f"{where}: rope_parameters is {params!r}, expected a mapping")
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not isinstance(scaling, dict | None):
        raise HFFormatError(f"{where}: rope_scaling is {scaling!r}, expected a mapping or null")
    theta = _number(hf, "rope_theta", float, where, _number(params, "rope_theta", float, where, 10000.0))
    if scaling is None:
        return {"rope_theta": float(theta), "rope_scaling": None}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if kind != "llama3":
        raise HFFormatError(f"{where}: rope_scaling type {kind!r} does not map (only Llama-3 'llama3' scaling does)")
    return {
        "rope_theta": float(theta),
        "rope_scaling": {
            "factor": _number(scaling, "factor", float, f"{where}: rope_scaling"),
            "low_freq_factor": _number(scaling, "low_freq_factor", float, f"{where}: rope_scaling"),
            "high_freq_factor": _number(scaling, "high_freq_factor", float, f"{where}: rope_scaling"),
            "original_max_position": _number(
                scaling, "original_max_position_embeddings", int, f"{where}: rope_scaling"
            ),
        },
    }


def _require(hf: dict[str, Any], key: str, want: Any, where: str) -> None:
    if hf.get(key, want) != want:
        raise HFFormatError(f"{where}: {key} is {hf[key]!r}; only {want!r} maps onto this framework's Llama")


def _number(hf: dict[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    """`hf[key]` as an int or float (`default` when absent or null; required without one)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise HFFormatError(f"{where}: missing key {key!r} of a Llama config")
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not integral):
        raise HFFormatError(f"{where}: {key} is {value!r}, expected {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _flag(hf: dict[str, Any], key: str, where: str) -> bool:
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HFFormatError(f"{where}: {key} is {value!r}, expected true or false")
    return value


def model_keys_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our `model` config keys of a transformers LlamaConfig dict; one-line error where the
    architecture does not map."""
    if hf.get("model_type") != "llama":
        raise HFFormatError(
            f"{where}: model_type is {hf.get('model_type')!r}; only Hugging Face Llama ('llama') models map"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        _require(hf, key, want, where)
    d, heads = _number(hf, "hidden_size", int, where), _number(hf, "num_attention_heads", int, where)
    keys = {
        "vocab_size": _number(hf, "vocab_size", int, where),
        "d_model": d,
        "n_layers": _number(hf, "num_hidden_layers", int, where),
        "n_heads": heads,
        "n_kv_heads": _number(hf, "num_key_value_heads", int, where, heads),
        "ffn_dim": _number(hf, "intermediate_size", int, where),
        "max_seq_len": _number(hf, "max_position_embeddings", int, where, 2048),
        "norm_eps": _number(hf, "rms_norm_eps", float, where, 1e-6),
        "tie_embeddings": _flag(hf, "tie_word_embeddings", where),
    }
    head_dim = hf.get("head_dim")
    if head_dim is not None and _number(hf, "head_dim", int, where) * heads != d:
        raise HFFormatError(
            f"{where}: head_dim {head_dim} x num_attention_heads {heads} != hidden_size {d} (does not map)"
        )
    return keys | _rope_keys(hf, where)


def hf_dtype(hf: dict[str, Any]) -> torch.dtype | None:
    """The parameter dtype a config.json names (`dtype` or `torch_dtype`), None when unnamed."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None
