"""Run a script of Triton kernel checks on the CPU under Triton's interpreter (TRITON_INTERPRET=1
is read when a kernel is built, so each script runs in its own process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Triton wheels exist for Linux x86-64 only.
needs_triton = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="Triton wheels exist for Linux x86-64 only"
)


def run_interpreted(script: str) -> None:
    """Run `script` (which prints "ok" last) with the repository importable; fail with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def faithful_dot() -> None:
    """Make the interpreter's `tl.dot` (in this process) compute what a GPU's does for bf16, fp16
    and fp32 operands: bf16 ones by their values (Triton 3.9's interpreter holds bf16 as its raw
    uint16 bits and multiplies those), and fp32 ones rounded to tf32 (10 mantissa bits) unless the
    dot asks for `input_precision="ieee"` (the interpreter ignores the precision and multiplies
    in fp32), so that a kernel that forgets "ieee" fails an fp32-accuracy check here too."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ieee = interpreter._ir.INPUT_PRECISION.IEEE
    plain = interpreter.InterpreterBuilder.create_dot

    def operand(t, precision):
        if t.dtype == tl.bfloat16:
            return interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
        if t.dtype == tl.float32 and precision != ieee:
            return interpreter._round_f32_to_tf32(t.data)
        return t.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype not in (tl.bfloat16, tl.float16, tl.float32) or d.dtype != tl.float32:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(operand(a, input_precision), operand(b, input_precision), dtype=np.float32)
        return interpreter.TensorHandle(prod + d.data, d.dtype)

    interpreter.InterpreterBuilder.create_dot = create_dot
