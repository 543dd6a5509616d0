"""mamba_ssm's Triton SSD kernel and causal-conv1d, loaded when installed (`model.mamba.kernel`).

The Mamba-2 authors' kernels (Dao & Gu 2024; the `mamba_ssm` package, the optional `[mamba]`
extra): `mamba_chunk_scan_combined` computes the chunked scan of
`trainer.model.mamba.ssd` in a few fused Triton kernels, forward and backward, and needs no CUDA
build. `causal_conv1d_fn` (the causal-conv1d package, CUDA C++) fuses the depthwise convolution
and its SiLU; without it the mixer keeps `F.conv1d`. Our PyTorch SSD stays the CPU path and the
fallback (`resolve_kernel`).

Importing mamba_ssm without its CUDA extensions fails: `mamba_ssm/__init__.py` imports
`ops/selective_scan_interface.py`, which runs `import selective_scan_cuda` unguarded (the Mamba-1
extension, which the Mamba-2 Triton path never calls). `mamba1_placeholder` registers an empty
module under that name for the one import, only when the real extension cannot be found, and
takes it out again, so that nothing else sees it.

The kernel's convention (`mamba_ssm.modules.mamba2.Mamba2.forward`, use_mem_eff_path=False, the
gated norm after the scan, rmsnorm=True): dt raw with `dt_bias` and `dt_softplus=True` (the
kernel adds the bias and applies softplus in fp32), A = -exp(A_log) in fp32, D per head, z None
(the gate is the norm's, `gated_group_rms_norm`), no seq_idx, no initial states;
batch-first [b, T, H, P] like `ssd_chunked`, and per tensor-parallel rank on its local heads.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from trainer.config.mamba import MAMBA_SSM_INSTALL
from trainer.config.tools import ConfigError
from trainer.model.mamba.ssd import ssd_reference

#: The Mamba-1 CUDA extension that `mamba_ssm/__init__.py` imports unguarded.
_MAMBA1_EXTENSION = "selective_scan_cuda"

KERNELS = ("auto", "mamba_ssm", "torch")


@contextmanager
def mamba1_placeholder() -> Iterator[None]:
    """An empty `selective_scan_cuda` module while mamba_ssm is imported, when the real one is
    missing (module docstring); the real extension, if installed, is left alone."""
    if _MAMBA1_EXTENSION in sys.modules or importlib.util.find_spec(_MAMBA1_EXTENSION) is not None:
        yield
        return
    sys.modules[_MAMBA1_EXTENSION] = types.ModuleType(_MAMBA1_EXTENSION, "placeholder: Mamba-1 kernels not built")
    try:
        yield
    finally:
        del sys.modules[_MAMBA1_EXTENSION]


@functools.cache
def _import_chunk_scan() -> tuple[Callable | None, str]:
    """(the kernel, "") or (None, why it does not import: mamba_ssm, or what its `__init__`
    imports, such as triton, einops or transformers, missing)."""
    try:
        with mamba1_placeholder():
            module = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"
    return module.mamba_chunk_scan_combined, ""


def load_chunk_scan() -> Callable | None:
    """`mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`, or None where it does not import."""
    return _import_chunk_scan()[0]


@functools.cache
def load_causal_conv1d() -> Callable | None:
    """`causal_conv1d.causal_conv1d_fn` when causal-conv1d is installed (built), else None."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


def resolve_kernel(requested: str, device: torch.device) -> str:
    """`model.mamba.kernel` on `device`: "mamba_ssm" or "torch". `auto` takes mamba_ssm on CUDA
    when it imports; `mamba_ssm` without CUDA or without the package is refused in one line."""
    if requested == "torch":
        return "torch"
    if requested not in KERNELS:
        raise ConfigError(f"model.mamba.kernel: expected one of {', '.join(KERNELS)}, got {requested!r}")
    if device.type != "cuda":
        if requested == "mamba_ssm":
            raise ConfigError(
                f"model.mamba.kernel: 'mamba_ssm' runs Triton kernels on CUDA, the device is {device.type} "
                f"(use auto or torch)"
            )
        return "torch"
    if load_chunk_scan() is None:
        if requested == "mamba_ssm":
            why = _import_chunk_scan()[1]
            raise ConfigError(f"model.mamba.kernel: 'mamba_ssm' does not import ({why}): {MAMBA_SSM_INSTALL}")
        return "torch"
    return "mamba_ssm"


def chunk_scan_combined_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """What `mamba_chunk_scan_combined` computes, in plain PyTorch through the token recurrence
    (`ssd_reference`), with its signature: the stand-in for the kernel in the tests that check
    the mixer's call on the CPU. dt (+ dt_bias, softplus, clamped to dt_limit) in fp32, the scan,
    + D x, times silu(z) when given; the output in x's dtype. chunk_size changes no value."""
    if initial_states is not None or seq_idx is not None:
        raise NotImplementedError("initial_states / seq_idx: the mixer passes neither")
    dt = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
    dt = F.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(*dt_limit)
    D = torch.zeros(x.shape[-2], device=x.device) if D is None else D
    y = ssd_reference(*(t.float() for t in (x, dt, A, B, C, D)))
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
