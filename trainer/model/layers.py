"""Llama building blocks that hold no process group: RMSNorm, the RoPE tables (with the Llama-3
frequency scaling) and the attention core. The rotation is `trainer.model.ops.rope`, the fused SwiGLU
`trainer.model.ops.swiglu`, the per-token cross entropy `trainer.model.ops.cross_entropy`. Activations
are [s, b, ...]; under sequence parallel RMSNorm marks its weight for the tp gradient sum."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.config.tools import ConfigError


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019, through the fused `F.rms_norm`. With sequence parallel the weight
    sees only this rank's part of the sequence: its gradient is summed over tp later."""

    def __init__(
        self,
        dim: int,
        eps: float,
        sequence_parallel: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        if sequence_parallel:
            self.weight._sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


# -- RoPE ---------------------------------------------------------------------------------------


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_position: int
) -> torch.Tensor:
    """Llama 3.1 RoPE scaling: wavelengths longer than original_max / low_freq_factor are
    stretched by `factor`, those shorter than original_max / high_freq_factor are kept, and the
    band in between is interpolated linearly in original_max / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, interpolated, out)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, scaling=None, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq_len, head_dim / 2] in fp32 for the rotate-half RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled_frequencies(
            inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position
        )
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return freqs.cos(), freqs.sin()


# -- attention core -----------------------------------------------------------------------------

#: SDPA backends on CUDA, fastest first: on Hopper cuDNN's fused attention runs the forward and
#: backward faster than the FlashAttention-2 kernels torch ships; SDPA falls through the list to
#: the first backend that supports the inputs (dtype, head dim, GQA), so correctness never depends
#: on cuDNN. Measured in experiments/notes/PERFORMANCE.md.
CUDA_SDPA_PRIORITY = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str, device: torch.device) -> str:
    """`auto`: flash-attn on CUDA when installed, else SDPA. `flash` without it is an error."""
    if requested == "sdpa":
        return "sdpa"
    available = device.type == "cuda" and flash_attn_available()
    if requested == "flash" and not available:
        raise ConfigError(
            f"model.attention: 'flash' needs CUDA and the flash_attn package "
            f"(device {device.type}, flash_attn installed: {flash_attn_available()})"
        )
    if requested not in ("auto", "flash"):
        raise ConfigError(f"model.attention: expected auto, sdpa or flash, got {requested!r}")
    return "flash" if available else "sdpa"


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    impl: str,
    priority: Sequence[SDPBackend] = CUDA_SDPA_PRIORITY,
    scale: float | None = None,
    batch_first: bool = False,
) -> torch.Tensor:
    """q [s, b, h, hd], k and v [s, b, kv, hd] (grouped-query when kv < h) -> [s, b, h * hd];
    under `batch_first` q, k, v [b, s, ., hd] -> [b, s, h * hd]. `priority`: the SDPA backends
    tried on CUDA, in order (`trainer.model.ops.kernels.Kernels`)."""
    if batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    s, b, h, hd = q.shape
    if impl == "flash" and q.dtype in (torch.float16, torch.bfloat16):
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True, softmax_scale=scale)
        return out.reshape(b, s, h * hd) if batch_first else out.transpose(0, 1).reshape(s, b, h * hd)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if q.device.type == "cuda":
        with sdpa_kernel(list(priority), set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != h)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != h)
    if batch_first:
        return out.permute(0, 2, 1, 3).reshape(b, s, h * hd)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * hd)
