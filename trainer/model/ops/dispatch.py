"""How an op with a Triton kernel reaches it: one owner for the import guard and the CUDA choice
that every such op (RoPE, cross entropy, SwiGLU, the optimizer's multi-tensor kernels) makes.

The kernels are imported on first use, so that importing an op never needs Triton (a CPU install
has none) and TRITON_INTERPRET=1, the tests' CPU mode, is read when the kernels are made. On CUDA
an op runs its Triton kernel when Triton is there and its torch ops otherwise, decided at each
call (a process may import the op before it knows its device).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def triton_kernels_of(module: str, *names: str) -> tuple | None:
    """The attributes `names` of the kernels' `module`, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    mod = importlib.import_module(module)
    return tuple(getattr(mod, n) for n in names)


def triton_or_torch(kernels: Callable[[], object], torch_impl: F, triton_impl: F) -> F:
    """An op's CUDA kernel (`register_kernel("cuda")`): `triton_impl` where `kernels()` found
    Triton, else `torch_impl`, the same math in torch ops."""

    def cuda(*args):
        return (torch_impl if kernels() is None else triton_impl)(*args)

    return cuda
