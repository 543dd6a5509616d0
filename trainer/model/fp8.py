"""FP8 matmuls for chosen linear layers (`model.fp8`), in the column/row-parallel linears of
`trainer.parallel.tensor`, on torchao's float8 training (`torchao.float8`, the optional `[fp8]`
extra; design.md section "FP8 linears and spectral muP").

Each of a linear's three GEMMs (forward y = x W^T, input gradient g W, weight gradient g^T x)
multiplies its two operands in FP8: weights and activations in e4m3 (3 mantissa bits, max 448),
gradients in e4m3 or e5m2 (2 mantissa bits, max 57344: range for the heavy-tailed gradients),
as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning". A tensor t with scale s is
saturate(t * s) in FP8, s = fp8_max / amax(t); the GEMM applies 1 / (s_A s_B) to the fp32
accumulator. Master weights, optimizer and checkpoints stay as they are: the FP8 copies exist
only inside a GEMM.

What is torchao's and what is ours. The scales from amaxes (`amax_to_scale`), the casts
(`hp_tensor_and_scale_to_float8`), the GEMMs (`torch._scaled_mm` through `Float8TrainingTensor`,
or torchao's emulation off Hopper/Ada) and, at tp 1 with dynamic scaling, the whole linear
(`matmul_with_hp_or_float8_args`, which `torch.compile` fuses with its neighbours: no graph
break) are torchao's. Ours is only what torchao lacks for a manual, non-DTensor tensor parallel:
the amaxes over a dim that tp splits, max-all-reduced over tp (a scalar for tensorwise, a
row/column vector for rowwise), and delayed scaling, which torchao 0.18 removed (`ScalingType`
has only DYNAMIC and DISABLED); both hand torchao a ready (tensor, scale) pair.

Scaling (`model.fp8.scaling`):
- tensorwise (torchao's `tensorwise` recipe): one scale per operand; from the operand's own
  amax (dynamic, `amax_history: 0`) or from the max over the last `amax_history` steps' amaxes
  (delayed scaling, Transformer Engine's recipe: the scale of step t is known before step t, so
  it is the same for every micro-batch and for a recomputed forward; the first step has no
  history and is dynamic). The step's amaxes are rolled into the history by `end_fp8_step`,
  max-reduced over tp and dp so that every replica uses the same scales. Only training GEMMs
  record (not evaluation or a frozen reference's forwards); the histories go into checkpoints
  (`amax_histories`). Delayed scaling runs through the eager tp path (a graph break per linear).
- rowwise (torchao's `rowwise` recipe: e4m3 gradients, scales rounded down to powers of two):
  one scale per row of A and per column of B, along the dims that are not contracted: per token
  for activations and their gradients in the forward and input-gradient GEMMs, per output
  feature for weights, and per feature (over tokens) in the weight-gradient GEMM. Always dynamic.

Layout invariance: with the tp-reduced amaxes every element is quantised with the
single-process scale, to the single-process FP8 value, and the sharded GEMMs differ from one
process (torchao's own linear) only by fp32 summation order. A dynamic scale (and a delayed
one's first step) is the amax of one micro-batch, so runs are comparable at the same
micro-batch size (global batch / (dp x micro-batches)), whatever else the layout
(experiments/results/layouts_cpu.md).

Execution: `torch._scaled_mm` on CUDA devices of compute capability >= 8.9 when the linear's
(local) weight dims are multiples of 16 (the tokens of a micro-batch must be too); elsewhere
torchao's emulation (`emulate`: the same casts, then upcast and an fp32 matmul), which
reproduces the quantisation exactly (fp8 x fp8 products are exact in fp32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.config.fp8 import FP8_LAYERS, HEAD, require_torchao
from trainer.config.tools import ConfigError
from trainer.parallel.tied import head_weight

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

COLUMN, ROW = "column", "row"


def native_fp8(device: torch.device) -> bool:
    """`torch._scaled_mm` runs here: CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def linear_config(scaling: str, grad_dtype: str, emulate: bool):
    """torchao's `Float8LinearConfig` for a `model.fp8` setting: its recipe of that name, with
    the gradients' format from `grad_dtype` (tensorwise; rowwise's recipe is e4m3, which
    `Fp8Config.validate` requires)."""
    require_torchao()
    from torchao.float8.config import CastConfig, Float8LinearConfig

    if scaling == "tensorwise":
        grads = CastConfig(target_dtype=FP8_DTYPES[grad_dtype])
        return Float8LinearConfig(cast_config_grad_output=grads, emulate=emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=emulate)


def mm_config(cfg):
    """torchao's per-GEMM settings (`LinearMMConfig`) for `cfg`, as `Float8Linear` builds them."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    gemms = (cfg.gemm_config_output, cfg.gemm_config_grad_input, cfg.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(cfg.emulate, g.use_fast_accum, False, cfg.pad_inner_dim) for g in gemms))


@dataclass
class Operand:
    """One GEMM operand as it enters the product (A [M, K] or B [K, N]). `split`: which of its
    two dims is this rank's tp shard of the single-process tensor (None: full or replicated).
    `role`: "x", "w" or "g", torchao's `GemmInputRole` and the amax history it belongs to."""

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
    state dict). `style`: COLUMN (W's rows split over tp) or ROW (W's columns split). `native`:
    `torch._scaled_mm` (else torchao's emulation)."""

    def __init__(self, style: str, tp, scaling: str, grad_dtype: str, amax_history: int = 0, native: bool = False):
        if style not in (COLUMN, ROW):
            raise ValueError(f"Fp8Matmul: style must be {COLUMN} or {ROW}, got {style!r}")
        self.style, self.tp, self.scaling, self.native = style, tp, scaling, native
        self.grad_dtype = FP8_DTYPES[grad_dtype]
        self.config = linear_config(scaling, grad_dtype, emulate=not native)
        self.mm_config = mm_config(self.config)
        self.delayed = AmaxHistory(amax_history) if amax_history > 0 and scaling == "tensorwise" else None
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale

        self._linear, self._to_float8, self._amax_to_scale = (
            matmul_with_hp_or_float8_args,
            hp_tensor_and_scale_to_float8,
            amax_to_scale,
        )
        self._roles = {"x": GemmInputRole.INPUT, "w": GemmInputRole.WEIGHT, "g": GemmInputRole.GRAD_OUTPUT}
        #: A frozen weight's FP8 copy (W^T), cast once (`freeze_weight`); None: cast per forward.
        self.frozen_weight_t = None

    def freeze_weight(self, w: torch.Tensor) -> None:
        """For a model whose weights never change (the DoReMi reference, doremi/methods/reference.py):
        cast `w` (in the dtype the linear computes in) to FP8 once, as torchao's `linear` would at
        every forward, to the same values (a dynamic scale of an unchanged weight). tp 1 and
        dynamic scaling only (`whole`): the tp path reduces amaxes per forward."""
        if not self.whole or self.tp.size != 1:
            raise ValueError("Fp8Matmul.freeze_weight: only a tp-1 linear with dynamic scaling")
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

        cast = self.config.cast_config_weight
        self.frozen_weight_t = hp_tensor_to_float8_dynamic(
            w.detach().t(),
            cast.target_dtype,
            self.mm_config,
            gemm_input_role=self._roles["w"],
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def __deepcopy__(self, memo) -> Fp8Matmul:
        length = self.delayed.length if self.delayed is not None else 0
        return Fp8Matmul(self.style, self.tp, self.scaling, _dtype_name(self.grad_dtype), length, self.native)

    @property
    def whole(self) -> bool:
        """Dynamic scaling: at tp 1 the linear is torchao's own (`linear`), compiled with the model."""
        return self.delayed is None

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """y = x W^T at tp 1 with dynamic scaling: torchao's float8 linear as it stands (its
        autograd Function is `allow_in_graph`, so `torch.compile` traces it with the model)."""
        w_t = w.t() if self.frozen_weight_t is None else self.frozen_weight_t
        return self._linear.apply(x, w_t, self.mm_config, self.config)

    # -- scales -------------------------------------------------------------------------------
    def _amax(self, op: Operand, dim: int | None) -> torch.Tensor:
        """amax over `dim` (None: the whole tensor), max-reduced over tp where it spans a split dim."""
        a = op.t.detach().abs()
        a = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
        if op.split is not None and (dim is None or dim == op.split) and self.tp.size > 1:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.tp.group)
        return a

    def _amax_for_scale(self, op: Operand, contracted: int, record: bool) -> torch.Tensor:
        if self.scaling == "rowwise":
            return self._amax(op, contracted)
        if self.delayed is not None:
            past = self.delayed.amax(op.role)
            if past is not None:
                if record:
                    self.delayed.record(op.role, op.t.detach().abs().amax())
                return past
            current = self._amax(op, None)
            if record:
                self.delayed.record(op.role, current)
            return current
        return self._amax(op, None)

    def _cast(self, op: Operand, contracted: int, record: bool):
        """`op` as torchao's `Float8TrainingTensor`, scaled from our (tp-reduced or delayed) amax."""
        amax = self._amax_for_scale(op, contracted, record)
        scale = self._amax_to_scale(amax, op.dtype, self.config.round_scales_to_power_of_2)
        axis = None if self.scaling == "tensorwise" else (0 if contracted == 0 else -1)
        return self._to_float8(op.t, scale, op.dtype, self.mm_config, self._roles[op.role], axis)

    # -- one GEMM -----------------------------------------------------------------------------
    def gemm(self, a: Operand, b: Operand, record: bool = True) -> torch.Tensor:
        """A [M, K] @ B [K, N] with both operands in FP8 -> [M, N] in A's dtype. `record`: the
        operands' amaxes go into this step's delayed-scaling history (training GEMMs)."""
        return torch.mm(self._cast(a, 1, record), self._cast(b, 0, record))

    # -- the linear's three products (x [..., in_local], w [out_local, in_local], g [..., out_local])
    def forward(self, x: torch.Tensor, w: torch.Tensor, record: bool = True) -> torch.Tensor:
        """`record` False for a forward without a backward (evaluation, a frozen reference):
        it does not move the scales. The caller decides, outside the autograd Function, where
        grad mode is always off."""
        col = self.style == COLUMN
        e4m3 = torch.float8_e4m3fn
        a = Operand(_flat(x), e4m3, None if col else 1, "x")
        b = Operand(w.t(), e4m3, 1 if col else 0, "w")
        return self.gemm(a, b, record).view(*x.shape[:-1], w.shape[0])

    def grad_input(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        col = self.style == COLUMN
        a = Operand(_flat(g), self.grad_dtype, 1 if col else None, "g")
        b = Operand(w, torch.float8_e4m3fn, 0 if col else 1, "w")
        return self.gemm(a, b).view(*g.shape[:-1], w.shape[1])

    def grad_weight(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        col = self.style == COLUMN
        a = Operand(_flat(g).t(), self.grad_dtype, 0 if col else None, "g")
        b = Operand(_flat(x), torch.float8_e4m3fn, None if col else 1, "x")
        return self.gemm(a, b)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in FP8_DTYPES.items() if v == dtype)


# -- the model ----------------------------------------------------------------------------------


def apply_fp8(stage: nn.Module, fp8_cfg, device: torch.device | None = None) -> int:
    """Give every linear named in `fp8_cfg.layers` (`FP8_LAYERS`) of `stage`'s blocks an
    `Fp8Matmul`, and the last stage's LM head one (`stage.head_fp8`) where `layers` names
    `head`; returns how many. The embedding lookup stays in high precision, and the head does
    unless asked for (opt in: the logits' and the loss's sensitivity, which every FP8 recipe but
    torchao's unfiltered `convert_to_float8_training` respects). A linear runs
    `torch._scaled_mm` on a `native_fp8` device when its local weight's dims are multiples of
    16, else torchao's emulation."""
    if fp8_cfg is None:
        return 0
    from trainer.parallel.tensor import RowParallelLinear

    native = device is not None and native_fp8(device)

    def matmul(style: str, tp, weight: torch.Tensor) -> Fp8Matmul:
        aligned = all(d % 16 == 0 for d in weight.shape)
        return Fp8Matmul(style, tp, fp8_cfg.scaling, fp8_cfg.grad_dtype, fp8_cfg.amax_history, native and aligned)

    suffixes = tuple("." + FP8_LAYERS[name] for name in fp8_cfg.layers if name in FP8_LAYERS)
    n = 0
    for name, module in stage.named_modules():
        if suffixes and name.endswith(suffixes):
            module.fp8 = matmul(ROW if isinstance(module, RowParallelLinear) else COLUMN, module.tp, module.weight)
            n += 1
    if HEAD in fp8_cfg.layers and getattr(stage, "is_last", False):
        stage.head_fp8 = matmul(COLUMN, stage.tp, head_weight(stage))
        n += 1
    return n


def _named_matmuls(model: nn.Module) -> list[tuple[str, Fp8Matmul]]:
    """Every `Fp8Matmul` of `model` by its linear's module name: a block linear's own (`fp8`),
    and a stage's LM head (`head_fp8`, named `head`, tied or not: the head is the matmul)."""
    out = []
    for name, m in model.named_modules():
        if getattr(m, "fp8", None) is not None:
            out.append((name, m.fp8))
        if getattr(m, "head_fp8", None) is not None:
            out.append((f"{name}.{HEAD}" if name else HEAD, m.head_fp8))
    return out


def fp8_matmuls(model: nn.Module) -> list[Fp8Matmul]:
    return [mm for _, mm in _named_matmuls(model)]


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
    return {name: mm.delayed for name, mm in _named_matmuls(model) if mm.delayed is not None}


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
