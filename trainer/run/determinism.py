"""`train.deterministic`: bitwise repeatable runs on the GPU.

A paired comparison of two mixtures is worth something only if the two arms differ in nothing
but the mixture. The first real-corpus study (experiments/results/doremi_real.md) ran with the
default kernels: two runs of the same seed drifted 0.107 nats apart by step 50, so the "paired"
arms were not paired (their differences correlated -0.86 with the baseline). Three switches,
set before the first cuBLAS call, make a CUDA run a function of its seeds
(../shared/study-design.md, "Measured since": 0.78-0.81x the default throughput):

- `torch.use_deterministic_algorithms(True)`: every op takes its deterministic kernel, and an op
  that has none raises instead of silently breaking the promise;
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: cuBLAS uses fixed workspaces, without which its split-K
  reductions may order their sums differently from call to call (cuBLAS reproducibility notes);
- `torch._inductor.config.deterministic = True`: compiled kernels skip autotuning by timing
  and atomics-based reductions, so the same graph compiles to the same kernels in every run.

On the CPU the trainer's ops are already deterministic; the switches change nothing there
(tests/test_determinism.py checks two same-seed runs bitwise on the CPU).
"""

from __future__ import annotations

import os

import torch

#: The cuBLAS workspace setting its documentation names for reproducible results.
CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(enabled: bool) -> None:
    """Switch the process's kernels to deterministic ones (or back to torch's defaults).

    These are process-wide torch flags, so the caller sets them once per run, before the model
    is built. The cuBLAS variable is read when a device's cuBLAS handle is created, so it only
    takes effect when set before the process's first matrix product on that device; it is left
    in place when the switch goes off (it costs nothing measurable outside split-K GEMMs)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = enabled


def is_deterministic() -> bool:
    """Whether the switches of `set_deterministic(True)` are on in this process."""
    import torch._inductor.config as inductor_config

    return torch.are_deterministic_algorithms_enabled() and bool(inductor_config.deterministic)
