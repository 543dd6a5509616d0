"""What a training run says about itself on rank 0: where it stands when it starts, what it runs
on, and what it did. A researcher reads these lines, not the code, to know whether a command
trained, resumed, or found nothing to do, and on which device and precision."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.build import RunFacts
from trainer.config.mamba import has_mamba
from trainer.config.schema import TrainerConfig
from trainer.model.flops import param_count
from trainer.model.mamba.kernels import resolve_kernel
from trainer.parallel.context import ParallelContext


def decision_line(run_dir: str | Path, start_step: int, steps: int) -> str:
    """`new run in DIR`, `resuming DIR from step N of M`, or `nothing to do: DIR finished at step N`."""
    if start_step == 0:
        return f"new run in {run_dir} ({steps} steps)"
    if start_step >= steps:
        return f"nothing to do: {run_dir} finished at step {start_step}"
    return f"resuming {run_dir} from step {start_step} of {steps}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def startup_line(cfg: TrainerConfig, facts: RunFacts, pc: ParallelContext, auto: Sequence[str] = ()) -> str:
    """Device, precision, layout, batch split and model size in one line, so that a GPU job
    running on the CPU (a CPU build of torch) or in fp32 shows it at once; then what the `auto`
    values resolved to (`trainer.config.schema.auto_notes`), so that a chosen value is seen."""
    t = cfg.train
    compute = "bf16" if facts.bf16 else "fp32"
    return (
        f"device {device_name(facts.device)}, compute {compute}, param dtype {_dtype(facts.param_dtype)}, "
        f"layout tp{pc.tp} x pp{pc.pp} x dp{pc.dp}, global batch {t.global_batch_size} = "
        f"{t.micro_batches} micro-batch(es) of {facts.micro_batch_size} x dp{pc.dp}, "
        f"{param_count(cfg.model) / 1e6:.2f}M parameters"
        + "".join(f", {note}" for note in [*_mamba_kernel(cfg, facts), *auto])
    )


def _mamba_kernel(cfg: TrainerConfig, facts: RunFacts) -> list[str]:
    """A hybrid's scan kernel as resolved on the device (`model.mamba.kernel`), e.g. `mamba
    kernel mamba_ssm (auto)`: whether the Triton kernel or our PyTorch scan runs is seen."""
    if not has_mamba(cfg.model):
        return []
    requested = cfg.model.mamba.kernel
    resolved = resolve_kernel(requested, facts.device)
    return [f"mamba kernel {resolved}" + (f" ({requested})" if requested != resolved else "")]


#: Present when the NVIDIA driver is loaded: the node has GPUs whatever torch was built for.
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def cpu_build_note(device: torch.device, driver: Path = NVIDIA_DRIVER) -> str | None:
    """A warning line when a run trains on the CPU of a node with NVIDIA GPUs because this torch
    has no CUDA (`make TORCH_SPEC=...` installs another build); None otherwise."""
    if device.type != "cpu" or torch.backends.cuda.is_built() or not driver.exists():
        return None
    return (
        f"warning: this node has NVIDIA GPUs but torch {torch.__version__} is a CPU build: training on the CPU "
        f"(install a CUDA build, e.g. `make TORCH_SPEC=torch install`)"
    )


def _losses(values: dict[str, Any]) -> str:
    return ", ".join(f"{d} {v:.4f}" if isinstance(v, float) else f"{d} {v}" for d, v in values.items())


def summary_lines(run_dir: str | Path, step: int, last: dict[str, Any], weights_file: Path | None = None) -> list[str]:
    """What the run left: its directory and step, the last logged train loss, the last per-domain
    validation losses when it evaluated, the step each domain was read to `data.max_epochs`, and
    a proxy's weights file."""
    lines = [f"run directory {run_dir}: step {step}"]
    if "loss" in last:
        lines.append(f"final train loss {last['loss']:.4f}")
    if isinstance(last.get("val_loss"), dict):
        lines.append(f"final validation loss: {_losses(last['val_loss'])}")
    exhausted = {d: t for d, t in (last.get("exhausted") or {}).items() if t is not None}
    if exhausted:
        lines.append("read to data.max_epochs: " + ", ".join(f"{d} at step {t}" for d, t in exhausted.items()))
    if weights_file is not None:
        lines.append(f"domain weights: {weights_file}")
    return lines


def say(lines: str | list[str], is_main: bool, stream: Any = None) -> None:
    """Print on rank 0 only (stderr unless told)."""
    if not is_main:
        return
    for line in [lines] if isinstance(lines, str) else lines:
        print(line, file=stream or sys.stderr, flush=True)
