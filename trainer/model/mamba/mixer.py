"""The Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", section 7), tensor-parallel.

    [z | x | B | C | dt] = in_proj(u)                       one fused projection (section 7.1)
    x, B, C = silu(causal depthwise conv1d([x | B | C]))     width d_conv, per channel, with bias
    dt = softplus(dt + dt_bias),  A = -exp(A_log)
    y = SSD(x, dt, A, B, C) + D x                            `trainer.model.mamba.ssd`
    out = out_proj(RMSNorm_group(y * silu(z)))               gated norm, per group of heads

Heads of dimension P = `model.mamba.head_dim`, H = expand d_model / P of them, in G =
`ngroups` groups that share B and C (the multi-value form of section 7.2).

Tensor parallel (the paper's section 8.1): `in_proj` is column-parallel, cut per part (z, x,
B, C, dt) so each rank holds whole groups with their heads; the convolution, dt_bias, A_log, D
and the gated norm's weight are per channel or per head and split the same way (no collective);
the gated norm normalises within a group, which lies on one rank; `out_proj` is row-parallel
(the Mamba rows of `trainer.model.sharding`).
So a Mamba block costs the same two collectives as an attention block, and tp must divide G.
With sequence parallel the in_proj all-gathers the sequence before the convolution and the scan
(both need the whole sequence) and out_proj reduce-scatters after them, as for attention.

Layout: the block's activations are [s, b, d]; the scan runs batch-first.

The scan's kernel (`model.mamba.kernel`, `trainer.model.mamba.kernels`): mamba_ssm's Triton
`mamba_chunk_scan_combined` on CUDA when installed (and causal-conv1d's fused convolution + SiLU
when that is), else `ssd_chunked`; both get this rank's heads, so tensor parallelism is the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.model.mamba.kernels import load_causal_conv1d, load_chunk_scan, resolve_kernel
from trainer.model.mamba.ssd import ssd_chunked
from trainer.model.sharding import plan_parameter, tp_module
from trainer.parallel.tensor import TensorParallel

#: Mamba parameters whose initialisation is not the normal(0, init_std) of `trainer.model.init`.
_SPECIAL_INIT = ("mamba.conv_weight", "mamba.conv_bias", "mamba.dt_bias", "mamba.A_log", "mamba.D")


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [b, c, T], weight [c, K], bias [c] -> [b, c, T]: out_t = sum_k w_k x_{t-K+1+k} + bias."""
    k = weight.shape[-1]
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]


def gated_group_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """Mamba-2's RMSNormGated (norm after the gate): RMSNorm of y * silu(z) over each group of
    `group` channels, times the weight. [..., c] -> [..., c]."""
    g = (y * F.silu(z)).unflatten(-1, (-1, group))
    return F.rms_norm(g, (group,), eps=eps).flatten(-2) * weight


class Mamba2Mixer(nn.Module):
    """See the module docstring. Parameters (single-process shapes; d_i = expand d_model, c = d_i
    + 2 G N): in_proj [2 d_i + 2 G N + H, d], conv_weight [c, d_conv], conv_bias [c], dt_bias,
    A_log, D [H], norm [d_i], out_proj [d, d_i]."""

    def __init__(self, cfg, tp: TensorParallel, device=None):
        super().__init__()
        m = cfg.mamba
        d_inner, heads, bc = m.d_inner(cfg.d_model), m.n_heads(cfg.d_model), m.ngroups * m.d_state
        self.chunk_size, self.eps = m.chunk_size, cfg.norm_eps
        self.head_dim, self.d_state = m.head_dim, m.d_state
        self.local_inner, self.local_heads = d_inner // tp.size, heads // tp.size
        self.local_groups, self.group_size = m.ngroups // tp.size, d_inner // m.ngroups
        self.recompute_core = False
        self.kernel = resolve_kernel(m.kernel, torch.device(device or "cpu"))
        #: `mamba_chunk_scan_combined`'s signature (tests put `chunk_scan_combined_reference` here).
        self.chunk_scan = load_chunk_scan() if self.kernel == "mamba_ssm" else None
        self.conv_silu = load_causal_conv1d() if self.kernel == "mamba_ssm" else None
        self.in_proj = tp_module("mamba.in_proj", tp, (d_inner, d_inner, bc, bc, heads), cfg.d_model, device=device)
        conv = (d_inner, bc, bc)
        self.conv_weight = plan_parameter("mamba.conv_weight", (sum(conv), m.d_conv), tp, conv, device=device)
        self.conv_bias = plan_parameter("mamba.conv_bias", (sum(conv),), tp, conv, device=device)
        self.dt_bias = plan_parameter("mamba.dt_bias", (heads,), tp, device=device)
        self.A_log = plan_parameter("mamba.A_log", (heads,), tp, device=device)
        self.D = plan_parameter("mamba.D", (heads,), tp, device=device)
        self.norm = nn.Module()
        self.norm.weight = plan_parameter("mamba.norm.weight", (d_inner,), tp, device=device)
        self.out_proj = tp_module("mamba.out_proj", tp, (cfg.d_model,), d_inner, device=device)

    def core(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """Convolution, scan and gated norm: [s, b, in_proj out / tp] -> [s, b, d_inner / tp]."""
        di, gn = self.local_inner, self.local_groups * self.d_state
        z, xbc, dt = zxbcdt.split([di, di + 2 * gn, self.local_heads], dim=-1)
        xbc = xbc.permute(1, 2, 0)
        if self.conv_silu is not None:
            xbc = self.conv_silu(xbc, self.conv_weight, bias=self.conv_bias, activation="silu")
        else:
            xbc = F.silu(causal_depthwise_conv(xbc, self.conv_weight, self.conv_bias))
        x, B, C = xbc.transpose(1, 2).split([di, gn, gn], dim=-1)
        b, s = x.shape[:2]
        y = self.scan(
            x.unflatten(-1, (self.local_heads, self.head_dim)),
            dt.transpose(0, 1),
            B.unflatten(-1, (self.local_groups, self.d_state)),
            C.unflatten(-1, (self.local_groups, self.d_state)),
        )
        y = y.reshape(b, s, di).transpose(0, 1).to(z.dtype)
        return gated_group_rms_norm(y, z, self.norm.weight, self.group_size, self.eps)

    def scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """x [b, s, H, P], dt [b, s, H] before its bias and softplus, B and C [b, s, G, N] ->
        y [b, s, H, P] (fp32 from ours, x's dtype from the kernel; the caller casts). The
        kernel's call is Mamba2's with the gated norm after the scan (`kernels` docstring)."""
        A = -torch.exp(self.A_log.float())
        if self.chunk_scan is not None:
            return self.chunk_scan(
                x,
                dt,
                A,
                B,
                C,
                chunk_size=self.chunk_size,
                D=self.D,
                z=None,
                dt_bias=self.dt_bias,
                initial_states=None,
                seq_idx=None,
                dt_softplus=True,
            )
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return ssd_chunked(x, dt, A, B, C, self.D, self.chunk_size)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        zxbcdt = self.in_proj(u)
        if self.recompute_core:
            y = checkpoint(self.core, zxbcdt, use_reentrant=False, preserve_rng_state=False)
        else:
            y = self.core(zxbcdt)
        return self.out_proj(y)


def is_special_init(name: str) -> bool:
    return name.endswith(_SPECIAL_INIT)


def mamba_full_tensor(
    name: str, shape: tuple[int, ...], cfg, gen: torch.Generator, device: torch.device
) -> torch.Tensor | None:
    """The single-process initial value of a Mamba parameter that is not a plain normal matrix
    (None for the others), as mamba_ssm's Mamba2 initialises them: the convolution as PyTorch's
    Conv1d (uniform in +-1/sqrt(d_conv)); dt_bias the inverse softplus of dt drawn log-uniform
    in [dt_min, dt_max] (floored), so that softplus(dt_bias) starts at dt; A_log = log A with
    A uniform in [a_init_min, a_init_max]; D ones."""
    if not is_special_init(name):
        return None
    m = cfg.mamba
    u = torch.rand(shape, generator=gen, device=device)
    if name.endswith(("mamba.conv_weight", "mamba.conv_bias")):
        bound = 1.0 / math.sqrt(m.d_conv)
        return (2 * u - 1) * bound
    if name.endswith("mamba.dt_bias"):
        dt = torch.exp(u * (math.log(m.dt_max) - math.log(m.dt_min)) + math.log(m.dt_min)).clamp(min=m.dt_init_floor)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("mamba.A_log"):
        return torch.log(m.a_init_min + u * (m.a_init_max - m.a_init_min))
    return torch.ones(shape, device=device)
