"""Which blocks are Mamba-2 and the Mamba-2 mixer's shape: `model.block_pattern`, `model.mamba`.

A hybrid stack (Lieber et al. 2024, Jamba; Waleffe et al. 2024, "An Empirical Study of
Mamba-based Language Models") keeps attention in a few layers and a Mamba-2 mixer (Dao & Gu 2024)
in the others. Here every block is a token mixer followed by the SwiGLU MLP; the mixer is
attention (`A`) or Mamba-2 (`M`), one letter per layer in `model.block_pattern`, which is tiled
over `model.n_layers` and cut there (so `MMMA` on 8 layers puts attention in layers 3 and 7, and
`MA` on 3 layers is M A M: one pattern serves a proxy and a deeper main model). Empty: all
attention, the plain Llama.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from trainer.config.tools import ConfigError

ATTENTION, MAMBA = "attention", "mamba"
_LETTERS = {"A": ATTENTION, "M": MAMBA}

#: How to install the `mamba_ssm` scan kernel (`trainer.model.mamba.kernels`): the `[mamba]` extra,
#: built without its CUDA extensions, which the Mamba-2 Triton path never calls.
MAMBA_SSM_INSTALL = "MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation -e '.[mamba]' (mamba-ssm==2.3.2.post1)"


def mamba_ssm_installed() -> bool:
    """Whether the mamba_ssm package can be found (a lookup: nothing imported)."""
    return importlib.util.find_spec("mamba_ssm") is not None


@dataclass
class MambaConfig:
    """The Mamba-2 mixer of the `M` layers of `model.block_pattern` (Dao & Gu 2024, section 7)."""

    # State size N per head.
    d_state: int = 16
    # Width of the causal depthwise convolution over x, B and C.
    d_conv: int = 4
    # Inner width = expand x model.d_model.
    expand: int = 2
    # Head dimension P; heads = expand x d_model / head_dim.
    head_dim: int = 16
    # Groups sharing B and C (grouped heads); parallelism.tp must divide it.
    ngroups: int = 1
    # Tokens per chunk of the chunked scan (speed only: any value computes the same function).
    chunk_size: int = 64
    # Smallest initial time step dt (drawn log-uniform in [dt_min, dt_max]).
    dt_min: float = 0.001
    # Largest initial time step dt.
    dt_max: float = 0.1
    # Floor of the initial dt.
    dt_init_floor: float = 1e-4
    # Smallest initial -A (drawn uniform in [a_init_min, a_init_max]; A_log = log of it).
    a_init_min: float = 1.0
    # Largest initial -A.
    a_init_max: float = 16.0
    # The scan's kernel (speed only): `mamba_ssm` (its Triton `mamba_chunk_scan_combined`, CUDA,
    # the `[mamba]` extra), `torch` (`trainer.model.mamba.ssd`, any device), `auto` (mamba_ssm on
    # CUDA when it imports, else torch). trainer/model/mamba/kernels.py.
    kernel: Literal["auto", "mamba_ssm", "torch"] = "auto"

    def d_inner(self, d_model: int) -> int:
        return self.expand * d_model

    def n_heads(self, d_model: int) -> int:
        return self.d_inner(d_model) // self.head_dim

    def validate(self, path: str = "model.mamba") -> None:
        for name in ("d_state", "d_conv", "expand", "head_dim", "ngroups", "chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected a positive int, got {getattr(self, name)}")
        if not 0 < self.dt_min <= self.dt_max or self.dt_init_floor <= 0:
            raise ConfigError(
                f"{path}.dt_min: expected 0 < dt_min <= dt_max and dt_init_floor > 0, got dt_min={self.dt_min}, "
                f"dt_max={self.dt_max}, dt_init_floor={self.dt_init_floor}"
            )
        if not 0 < self.a_init_min <= self.a_init_max:
            raise ConfigError(
                f"{path}.a_init_min: expected 0 < a_init_min <= a_init_max, got {self.a_init_min}, {self.a_init_max}"
            )
        if self.kernel == "mamba_ssm" and not mamba_ssm_installed():
            raise ConfigError(
                f"{path}.kernel: 'mamba_ssm' needs the mamba_ssm package, not installed: {MAMBA_SSM_INSTALL}"
            )


def layer_mixers(pattern: str, n_layers: int) -> list[str]:
    """The mixer of every layer: `pattern` tiled over `n_layers` and cut (empty: all attention)."""
    if not pattern:
        return [ATTENTION] * n_layers
    return [_LETTERS[pattern[i % len(pattern)]] for i in range(n_layers)]


def has_mamba(model_cfg) -> bool:
    return "M" in (getattr(model_cfg, "block_pattern", "") or "")


def check_block_pattern(model_cfg, path: str = "model") -> None:
    """`block_pattern` letters and length, and the mixer's head layout when it has `M`."""
    pattern = model_cfg.block_pattern
    if set(pattern) - set(_LETTERS):
        raise ConfigError(
            f"{path}.block_pattern: expected letters A (attention) and M (Mamba-2), e.g. 'MMMA', got {pattern!r}"
        )
    if not has_mamba(model_cfg):
        return
    m, d = model_cfg.mamba, model_cfg.d_model
    if m.d_inner(d) % m.head_dim:
        raise ConfigError(
            f"{path}.mamba.head_dim: expected a divisor of expand x d_model = {m.d_inner(d)}, got {m.head_dim}"
        )
    if m.n_heads(d) % m.ngroups:
        raise ConfigError(
            f"{path}.mamba.ngroups: expected a divisor of the Mamba heads ({m.n_heads(d)}), got {m.ngroups}"
        )


def check_mamba_tp(model_cfg, tp: int) -> None:
    """Tensor parallel splits whole groups (each with its heads, B and C): tp divides ngroups."""
    if has_mamba(model_cfg) and model_cfg.mamba.ngroups % tp:
        raise ConfigError(
            f"parallelism.tp: expected a divisor of model.mamba.ngroups={model_cfg.mamba.ngroups} "
            f"(Mamba-2 heads are split by group), got {tp}"
        )


def n_mamba_layers(model_cfg) -> int:
    return layer_mixers(getattr(model_cfg, "block_pattern", ""), model_cfg.n_layers).count(MAMBA)


def mamba_projection_params(model_cfg) -> int:
    """One Mamba-2 mixer's matmul weights (d_i = expand d): in_proj d (2 d_i + 2 G N + H) and
    out_proj d_i d; what its FLOPs per token count besides the scan."""
    m, d = model_cfg.mamba, model_cfg.d_model
    di, heads, bc = m.d_inner(d), m.n_heads(d), m.ngroups * m.d_state
    return d * (2 * di + 2 * bc + heads) + di * d


def mamba_mixer_params(model_cfg) -> int:
    """One Mamba-2 mixer's parameters (d_i = expand d, c = d_i + 2 G N): its projections
    (`mamba_projection_params`), the convolution c (d_conv + 1), dt_bias, A_log and D 3 H, the
    gated norm d_i."""
    m, d = model_cfg.mamba, model_cfg.d_model
    di, heads, bc = m.d_inner(d), m.n_heads(d), m.ngroups * m.d_state
    return mamba_projection_params(model_cfg) + (di + 2 * bc) * (m.d_conv + 1) + 3 * heads + di


def ssd_flops_per_token(model_cfg) -> int:
    """Training FLOPs (x3 for forward + backward) per token of one layer's chunked scan beyond
    its parameters' matmuls, with chunk Q (`trainer.model.mamba.ssd.ssd_chunked`): within a chunk the
    C B^T scores 2 Q G N and their product with the inputs 2 Q H P, causal half counted as for
    attention; a chunk's state from its inputs 2 H P N and the outputs from the entering state
    2 H P N. The recurrence over chunks (H P N per chunk) is left out."""
    m, d = model_cfg.mamba, model_cfg.d_model
    heads = m.n_heads(d)
    within = m.chunk_size * (m.ngroups * m.d_state + heads * m.head_dim)
    return 3 * (within + 4 * heads * m.head_dim * m.d_state)
