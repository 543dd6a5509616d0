"""FP8 matmuls for chosen linear layers (`model.fp8`), in the column/row-parallel linears of
`trainer.parallel.tensor`.

Each of a linear's three GEMMs (forward y = x W^T, input gradient g W, weight gradient g^T x)
quantises its two operands to FP8 and multiplies them: weights and activations in e4m3
(3 mantissa bits, max 448), gradients in e4m3 or e5m2 (2 mantissa bits, max 57344: range for
the heavy-tailed gradients), as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning".
Quantisation of a tensor t with amax a: q = saturate(t * s) in FP8 with s = fp8_max / a, and
t ~ q / s. The GEMM is (q_A / s_A)(q_B / s_B) = (q_A q_B) / (s_A s_B): FP8 products, the scales
applied once to the fp32 accumulator. Master weights, optimizer and checkpoints stay as they are:
the FP8 copies exist only inside a GEMM.

Scaling (`model.fp8.scaling`):
- tensorwise: one scale per operand; from the operand's own amax (dynamic, `amax_history: 0`)
  or from the max over the last `amax_history` steps' amaxes (delayed scaling, Transformer
  Engine's recipe: the scale of step t is known before step t, so it is the same for every
  micro-batch and for a recomputed forward; the first step has no history and is dynamic).
  The step's amaxes are rolled into the history by `end_fp8_step`, max-reduced over tp and dp
  so that every replica uses the same scales. Only training GEMMs record (not evaluation or a
  frozen reference's forwards); the histories go into checkpoints (`amax_histories`).
- rowwise: one scale per row of A and per column of B, i.e. along the dims that are not
  contracted (a scale on the contracted dim would not factor out of the dot product): per token
  for activations and their gradients in the forward and input-gradient GEMMs, per output
  feature for weights, and per feature (over tokens) in the weight-gradient GEMM. Always dynamic.

Layout invariance: a tp shard's amax is not the full tensor's, so an amax over a dim that tp
splits is max-all-reduced over tp (a scalar for tensorwise, a row/column vector for rowwise).
Then every element is quantised with the single-process scale, to the single-process FP8
value, and the sharded GEMMs differ from one process only by fp32 summation order. A dynamic
scale (and a delayed one's first step) is the amax of one micro-batch, so runs are comparable
at the same micro-batch size (global batch / (dp x micro-batches)), whatever else the layout
(experiments/results/layouts_cpu.md).

Execution: `torch._scaled_mm` (torch >= 2.5: mat1 row-major, mat2 column-major, dims multiple
of 16, fp32 dequantisation scales 1/s: one element, or [M, 1] and [1, N] rowwise) on CUDA devices
of compute capability >= 8.9; elsewhere EMULATED: the same quantisation, then upcast and an
fp32 matmul. The emulation reproduces the quantisation error exactly (fp8 x fp8 products are
exact in fp32); only the accumulation order differs from the tensor cores'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.config.fp8 import FP8_LAYERS
from trainer.config.tools import ConfigError

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

#: Smallest amax a scale is computed from (an all-zero tensor quantises to zeros).
AMAX_EPS = 1e-12

COLUMN, ROW = "column", "row"


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s = fp8_max / amax (fp32), so that t * s spans the FP8 range."""
    return fp8_max(dtype) / amax.float().clamp(min=AMAX_EPS)


def quantise(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(t * scale) in `dtype` (values beyond the range clamp to +-fp8_max: a delayed
    scale may be too small for this step, and an FP8 cast of an out-of-range value is NaN on CUDA)."""
    m = fp8_max(dtype)
    return (t.float() * scale).clamp(-m, m).to(dtype)


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


def fake_quantise(t: torch.Tensor, dtype: torch.dtype, scaling: str = "tensorwise", dim: int = -1) -> torch.Tensor:
    """t through FP8 and back (fp32), dynamic scale: tensorwise, or rowwise (amax over `dim`)."""
    a = t.detach().abs().amax() if scaling == "tensorwise" else t.detach().abs().amax(dim=dim, keepdim=True)
    s = scale_from_amax(a, dtype)
    return dequantise(quantise(t, s, dtype), s)


def native_fp8(device: torch.device) -> bool:
    """`torch._scaled_mm` runs here: CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Operand:
    """One GEMM operand as it enters the product (A [M, K] or B [K, N]). `split`: which of its
    two dims is this rank's tp shard of the single-process tensor (None: full or replicated).
    `role`: "x", "w" or "g", the amax history it belongs to."""

    t: torch.Tensor
    dtype: torch.dtype
    split: int | None
    role: str


@dataclass
class AmaxHistory:
    """Delayed tensorwise scaling of one linear: per role, the amaxes of the last steps, and
    the running max of this step's (rolled in by `roll`)."""

    length: int
    steps: int = 0
    history: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    def record(self, role: str, amax: torch.Tensor) -> None:
        prev = self.pending.get(role)
        self.pending[role] = amax.float() if prev is None else torch.maximum(prev, amax.float())

    def amax(self, role: str) -> torch.Tensor | None:
        """The max over the history (None before the first roll: scale dynamically)."""
        h = self.history.get(role)
        return None if self.steps == 0 or h is None else h.max()

    def roll(self, reduced: dict[str, torch.Tensor]) -> None:
        for role, a in reduced.items():
            h = self.history.get(role)
            if h is None:
                h = torch.zeros(self.length, dtype=torch.float32, device=a.device)
            self.history[role] = torch.cat([a.reshape(1), h[:-1]])
        self.pending.clear()
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "history": {role: h.tolist() for role, h in sorted(self.history.items())}}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """float32 amaxes round-trip exactly through the JSON floats of `state_dict`."""
        self.steps = int(state["steps"])
        self.history = {
            role: torch.tensor(h, dtype=torch.float32, device=device) for role, h in state["history"].items()
        }
        self.pending.clear()


class Fp8Matmul:
    """The three GEMMs of one column- or row-parallel linear in FP8 (see the module docstring).
    Held by the linear as `fp8` (a plain object: no parameters, no buffers, nothing in the
    state dict). `style`: COLUMN (W's rows split over tp) or ROW (W's columns split)."""

    def __init__(self, style: str, tp, scaling: str, grad_dtype: str, amax_history: int = 0):
        if style not in (COLUMN, ROW):
            raise ValueError(f"Fp8Matmul: style must be {COLUMN} or {ROW}, got {style!r}")
        self.style, self.tp, self.scaling = style, tp, scaling
        self.grad_dtype = FP8_DTYPES[grad_dtype]
        self.delayed = AmaxHistory(amax_history) if amax_history > 0 and scaling == "tensorwise" else None

    def __deepcopy__(self, memo) -> Fp8Matmul:
        return Fp8Matmul(self.style, self.tp, self.scaling, _dtype_name(self.grad_dtype), self._history_length())

    def _history_length(self) -> int:
        return self.delayed.length if self.delayed is not None else 0

    # -- scales -------------------------------------------------------------------------------
    def _amax(self, op: Operand, dim: int | None) -> torch.Tensor:
        """amax over `dim` (None: the whole tensor), max-reduced over tp where it spans a split dim."""
        a = op.t.detach().abs()
        a = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
        if op.split is not None and (dim is None or dim == op.split) and self.tp.size > 1:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.tp.group)
        return a

    def _scale(self, op: Operand, contracted: int, record: bool) -> torch.Tensor:
        if self.scaling == "rowwise":
            return scale_from_amax(self._amax(op, contracted), op.dtype)
        if self.delayed is not None:
            past = self.delayed.amax(op.role)
            if past is not None:
                if record:
                    self.delayed.record(op.role, op.t.detach().abs().amax())
                return scale_from_amax(past, op.dtype)
            current = self._amax(op, None)
            if record:
                self.delayed.record(op.role, current)
            return scale_from_amax(current, op.dtype)
        return scale_from_amax(self._amax(op, None), op.dtype)

    # -- one GEMM -----------------------------------------------------------------------------
    def gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype, record: bool = True) -> torch.Tensor:
        """A [M, K] @ B [K, N] with both operands in FP8 -> [M, N] in `out_dtype`. `record`:
        the operands' amaxes go into this step's delayed-scaling history (training GEMMs)."""
        sa, sb = self._scale(a, 1, record), self._scale(b, 0, record)
        qa, qb = quantise(a.t, sa, a.dtype), quantise(b.t, sb, b.dtype)
        m, k = a.t.shape
        n = b.t.shape[1]
        if native_fp8(a.t.device) and not (m % 16 or k % 16 or n % 16) and _native_pair(a.dtype, b.dtype):
            one = self.scaling == "tensorwise"
            return torch._scaled_mm(
                qa.contiguous(),
                qb.t().contiguous().t(),
                scale_a=(1.0 / sa).reshape(1) if one else (1.0 / sa).reshape(m, 1).contiguous(),
                scale_b=(1.0 / sb).reshape(1) if one else (1.0 / sb).reshape(1, n).contiguous(),
                out_dtype=out_dtype if out_dtype != torch.float32 or one else torch.bfloat16,
            ).to(out_dtype)
        return (dequantise(qa, sa) @ dequantise(qb, sb)).to(out_dtype)

    # -- the linear's three products (x [..., in_local], w [out_local, in_local], g [..., out_local])
    def forward(self, x: torch.Tensor, w: torch.Tensor, record: bool = True) -> torch.Tensor:
        """`record` False for a forward without a backward (evaluation, a frozen reference):
        it does not move the scales. The caller decides, outside the autograd Function, where
        grad mode is always off."""
        col = self.style == COLUMN
        e4m3 = torch.float8_e4m3fn
        a = Operand(_flat(x), e4m3, None if col else 1, "x")
        b = Operand(w.t(), e4m3, 1 if col else 0, "w")
        return self.gemm(a, b, x.dtype, record).view(*x.shape[:-1], w.shape[0])

    def grad_input(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        col = self.style == COLUMN
        a = Operand(_flat(g), self.grad_dtype, 1 if col else None, "g")
        b = Operand(w, torch.float8_e4m3fn, 0 if col else 1, "w")
        return self.gemm(a, b, g.dtype).view(*g.shape[:-1], w.shape[1])

    def grad_weight(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        col = self.style == COLUMN
        a = Operand(_flat(g).t(), self.grad_dtype, 0 if col else None, "g")
        b = Operand(_flat(x), torch.float8_e4m3fn, None if col else 1, "x")
        return self.gemm(a, b, g.dtype)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in FP8_DTYPES.items() if v == dtype)


def _native_pair(a: torch.dtype, b: torch.dtype) -> bool:
    """`torch._scaled_mm` multiplies e4m3 x e4m3 and mixed e4m3 / e5m2, not e5m2 x e5m2."""
    return not (a == b == torch.float8_e5m2)


# -- the model ----------------------------------------------------------------------------------


def apply_fp8(stage: nn.Module, fp8_cfg) -> int:
    """Give every linear named in `fp8_cfg.layers` (`FP8_LAYERS`) of `stage`'s blocks an
    `Fp8Matmul`; returns how many. The head and embedding stay in high precision (the logits'
    and the loss's sensitivity, as in every FP8 recipe)."""
    if fp8_cfg is None:
        return 0
    from trainer.parallel.tensor import RowParallelLinear

    suffixes = tuple("." + FP8_LAYERS[name] for name in fp8_cfg.layers)
    n = 0
    for name, module in stage.named_modules():
        if name.endswith(suffixes):
            style = ROW if isinstance(module, RowParallelLinear) else COLUMN
            module.fp8 = Fp8Matmul(style, module.tp, fp8_cfg.scaling, fp8_cfg.grad_dtype, fp8_cfg.amax_history)
            n += 1
    return n


def fp8_matmuls(model: nn.Module) -> list[Fp8Matmul]:
    return [m.fp8 for m in model.modules() if getattr(m, "fp8", None) is not None]


@torch.no_grad()
def end_fp8_step(model: nn.Module, pc) -> None:
    """After an optimizer step: roll this step's amaxes into the delayed-scaling histories,
    max-reduced over tp and dp (one all-reduce each for the whole stage) so that every replica
    scales the next step alike. No-op without delayed scaling."""
    delayed = [m.delayed for m in fp8_matmuls(model) if m.delayed is not None]
    entries = [(d, role) for d in delayed for role in sorted(d.pending)]
    if not entries:
        for d in delayed:
            d.roll({})
        return
    flat = torch.stack([d.pending[role].reshape(()) for d, role in entries])
    for size, group in ((pc.tp, pc.tp_group), (pc.dp, pc.dp_group)):
        if size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    reduced: dict[int, dict[str, torch.Tensor]] = {id(d): {} for d in delayed}
    for (d, role), a in zip(entries, flat):
        reduced[id(d)][role] = a
    for d in delayed:
        d.roll(reduced[id(d)])


def _delayed_by_name(model: nn.Module) -> dict[str, AmaxHistory]:
    return {
        name: m.fp8.delayed
        for name, m in model.named_modules()
        if getattr(m, "fp8", None) is not None and m.fp8.delayed is not None
    }


def amax_histories(model: nn.Module, pc) -> dict[str, Any]:
    """Every delayed-scaling linear's amax history, by the linear's (global) module name, over
    all pipeline stages: what a resume needs to scale its next step as the uninterrupted run
    would. Collective over pp; the histories are already equal over tp and dp (`end_fp8_step`)."""
    local = {name: d.state_dict() for name, d in _delayed_by_name(model).items()}
    if pc.pp == 1:
        return local
    parts: list[Any] = [None] * pc.pp
    dist.all_gather_object(parts, local, group=pc.pp_group)
    return {name: state for part in parts for name, state in part.items()}


def load_amax_histories(model: nn.Module, state: dict[str, Any], device: torch.device, source: str) -> None:
    """Restore this stage's histories from `amax_histories`' output; a linear missing from it
    (a checkpoint written before histories were saved, or without delayed scaling) is refused:
    its first resumed step would scale dynamically where the uninterrupted run did not."""
    for name, delayed in _delayed_by_name(model).items():
        if name not in state:
            raise ConfigError(
                f"checkpoint {source}: no FP8 amax history for {name} (model.fp8.amax_history is "
                f"{delayed.length}); resume it with the amax_history it was written with, or start again"
            )
        if len(state[name]["history"].get("x", [])) not in (0, delayed.length):
            raise ConfigError(
                f"checkpoint {source}: FP8 amax history of {name} has {len(state[name]['history']['x'])} "
                f"steps but model.fp8.amax_history is {delayed.length}"
            )
        delayed.load_state_dict(state[name], device)
