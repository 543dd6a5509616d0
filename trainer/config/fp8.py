"""The `model.fp8` config (`Fp8Config`) and its checks against the model config; the FP8
matmuls it switches on are `trainer.model.fp8`'s. A config module, so that `trainer.config.schema`
holds it without importing the model."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Literal

from trainer.config.mamba import ATTENTION, layer_mixers
from trainer.config.tools import ConfigError

#: `model.fp8.layers` names -> the linear's name in a block (the default list).
FP8_LAYERS: dict[str, str] = {"qkv": "attn.qkv", "proj": "attn.out", "gate_up": "mlp.gate_up", "down": "mlp.down"}
#: `model.fp8.layers`' name of the LM head: opt in, never in the default list, because its
#: effect on the loss is unmeasured (experiments/notes/FP8.md, grid G1).
HEAD = "head"
#: Every name `model.fp8.layers` accepts.
FP8_LAYER_NAMES: tuple[str, ...] = (*FP8_LAYERS, HEAD)


#: The torchao releases whose float8 internals `trainer.model.fp8` is written against (the `[fp8]` extra).
TORCHAO_VERSIONS = ((0, 18), (0, 19))


def torchao_version() -> str | None:
    """The installed torchao's version, None without it (a metadata lookup: nothing imported)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_torchao(path: str = "model.fp8") -> None:
    """FP8 linears run on torchao's float8 training, an optional dependency: refuse `model.fp8`
    without it, or with a release whose internals differ, in one line that says what to install."""
    version = torchao_version()
    install = "pip install -e '.[fp8]' (torchao>=0.18,<0.19)"
    if version is None:
        raise ConfigError(f"{path}: FP8 linears run on torchao's float8 training, which is not installed: {install}")
    major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    lo, hi = TORCHAO_VERSIONS
    if not lo <= major_minor < hi:
        raise ConfigError(f"{path}: FP8 linears need torchao 0.18.x, found torchao {version}: {install}")


def check_fp8_layers(model_cfg, path: str = "model") -> None:
    """`model.fp8.layers` names linears the model has, each in every block of its kind: the MoE
    experts' grouped GEMMs have no FP8 path, so `gate_up`/`down` on a MoE model would run only
    its dense MLPs in FP8 and the experts silently not; `qkv`/`proj` need an attention layer."""
    fp8 = getattr(model_cfg, "fp8", None)
    if fp8 is None:
        return
    mlp = [name for name in fp8.layers if name in ("gate_up", "down")]
    if getattr(model_cfg, "moe", None) is not None and mlp:
        raise ConfigError(
            f"{path}.fp8.layers: the MoE experts' grouped GEMMs have no FP8 path, so {mlp} would run in FP8 "
            f"in the dense MLPs only; leave them out for a MoE model, got {fp8.layers}"
        )
    attn = [name for name in fp8.layers if name in ("qkv", "proj")]
    if attn and ATTENTION not in layer_mixers(model_cfg.block_pattern, model_cfg.n_layers):
        raise ConfigError(
            f"{path}.fp8.layers: {attn} are attention linears and model.block_pattern "
            f"{model_cfg.block_pattern!r} has no attention layer"
        )


@dataclass
class Fp8Config:
    """FP8 GEMMs for chosen linear layers (`trainer.model.fp8`); master weights, optimizer and
    checkpoints unchanged."""

    # Linears whose GEMMs run in FP8: any of qkv, proj (attention output), gate_up, down, and
    # head (the LM head, tied or not; opt in: not in the default, its accuracy is unmeasured).
    layers: list[str] = field(default_factory=lambda: list(FP8_LAYERS))
    # `tensorwise`: one scale per operand; `rowwise`: one per row / column (dynamic only).
    scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    # Format of the output gradients: e5m2 (range) or e4m3 (precision; rowwise needs it).
    grad_dtype: Literal["e4m3", "e5m2"] = "e5m2"
    # Tensorwise delayed scaling: scales from the max amax of the last N steps; 0: dynamic
    # (torchao's; delayed scaling is ours, torchao 0.18 has none, and runs eagerly).
    amax_history: int = 0

    def validate(self, path: str = "model.fp8") -> None:
        unknown = [name for name in self.layers if name not in FP8_LAYER_NAMES]
        if unknown or not self.layers:
            raise ConfigError(
                f"{path}.layers: expected a non-empty list of {', '.join(FP8_LAYER_NAMES)}, got {self.layers}"
            )
        require_torchao(path)
        if self.amax_history < 0:
            raise ConfigError(f"{path}.amax_history: expected >= 0, got {self.amax_history}")
        if self.scaling == "rowwise" and self.amax_history:
            raise ConfigError(f"{path}.amax_history: rowwise scaling is dynamic, expected 0, got {self.amax_history}")
        if self.scaling == "rowwise" and self.grad_dtype != "e4m3":
            raise ConfigError(
                f"{path}.grad_dtype: rowwise scaling needs e4m3 (torchao's rowwise recipe), got {self.grad_dtype}"
            )
