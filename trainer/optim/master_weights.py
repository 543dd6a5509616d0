"""Mixed-precision AdamW: bf16 model parameters, fp32 master weights and moments, fp32 main grads
(Micikevicius et al. 2018, "Mixed Precision Training", with bf16 so no loss scaling; the layout of
Megatron-LM's distributed optimizer, with ZeRO-1 at parameter granularity as `trainer.optim`).
The trainer's path for bf16 compute with AdamW (train.param_dtype, `trainer.optim.build.build_optimizer`).

Why: fp32 parameters under bf16 autocast cast every weight to bf16 in each forward, turn every
bf16 weight gradient into fp32 in backward and run AdamW over fp32 parameters: about 52 bytes
of memory traffic per parameter per step with clipping. Pure bf16 parameters updated in bf16
(the plain baseline) are cheaper (14 bytes) but round every update to 8 mantissa bits, so small
updates vanish. Here the model runs on bf16 parameters and the optimizer owns the fp32 truth:
the low halves of the masters, an int16 remainder per parameter whose high half is the bf16
parameter (`trainer.optim.adamw_update.split_fp32`), so that a master costs 2 bytes instead of 4.

Layout: the trainable parameters become views into one flat bf16 buffer. When the step sums
gradients (over micro-batches or ranks, `trainer.parallel.data_parallel.sums_gradients`) each also gets
an fp32 main grad, a view into one flat fp32 buffer in the same order (`trainer.parallel.data_parallel.
attach_main_grad`: after each micro-batch's backward the bf16 `.grad` is copied or added into it
and dropped, so accumulation over micro-batches is in fp32); otherwise the update reads
autograd's `.grad` where it lies (`trainer.optim.adamw_update.adamw_update_tensors`). The order is by
dp owner (ZeRO-1; one group without it), within an owner matrices then vectors (the
weight-decay groups of `trainer.optim`), each view 64-element aligned, so each owner's
parameters are one contiguous span. The remainders and the AdamW moments exist for this rank's
span only. Per step:
- `reduce_gradients`: the main grads summed over dp in fp32, in place, span by span: to the
  owner under ZeRO-1, to every rank without (`trainer.parallel.data_parallel.reduce_grads`);
- `clip_grad_norm`: the global L2 norm over the gradients (`trainer.optim.clip`, each
  parameter counted on its owner) and the clip coefficient, both on device;
- `step(lr)`: one fused elementwise kernel over this rank's span (`trainer.optim.adamw_update`) that
  scales the gradient by the clip coefficient, applies torch.optim.AdamW's update (decoupled
  weight decay on matrices only, bias corrections) to the fp32 master it joins from parameter
  and remainder, and splits the result back into both; under ZeRO-1 the owners then broadcast
  their spans of bf16 parameters (`broadcast_from_owners`, in place).
Traffic with fp32 main grads: 6 (bf16 `.grad` into the fp32 main grad) + 4 (norm) + 28
(update: parameter and remainder, moments, fp32 grad) = 38 bytes per parameter; each further
micro-batch adds 10 (the add). They buy exact fp32 accumulation and an fp32 dp reduction. When
nothing is summed (one micro-batch, one rank): 2 (norm) + 26 = 28 bytes, and the gradients
take memory only from their backward to the step. lr, the step count and the clip
coefficient live on the device, so a step has no host synchronisation.

State by name, as `trainer.optim`: torch AdamW's keys plus the fp32 "master" (joined) for the
parameters this rank owns, so checkpoints reshard it like any state shaped as its parameter,
and fp32-parameter checkpoints load here (master from the saved fp32 parameters) and back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import Parameter

from data.errors import UserError
from trainer.config.schema import TrainConfig
from trainer.optim.adamw_update import (
    BLOCK,
    UpdateState,
    adamw_update,
    adamw_update_combined,
    adamw_update_tensors,
    join_fp32,
    split_fp32,
    stacked_coefficients,
    uses_triton,
)
from trainer.optim.clip import clip_coefficient, global_grad_norm
from trainer.optim.multi_tensor import ADDRESS_ALIGN, TensorBlocks, aligned
from trainer.optim.param_groups import decay_first, lr_scale, scaled_weight_decay
from trainer.parallel.context import ParallelContext
from trainer.parallel.data_parallel import (
    DEFAULT_BUCKET_NUMEL,
    broadcast_from_owners,
    param_owners,
    reduce_grads,
    set_dp_owner,
    sums_gradients,
)
from trainer.parallel.expert import expert_parallel_of
from trainer.parallel.main_grad import attach_main_grad, reset_main_grads

#: Each parameter's view starts at a multiple of this many elements (128 bytes in bf16): compiled
#: kernels assume aligned inputs and copy misaligned ones. The gaps stay zero in every buffer.
ALIGN_ELEMENTS = 64


class MasterWeightStateError(UserError, ValueError):
    """An optimizer state that does not fit this optimizer: one line naming the parameter."""


def _is_dense(named: tuple[str, Parameter]) -> bool:
    return expert_parallel_of(named[1]) is None


def _aligned_offsets(numels: Sequence[int], multiple: int = ALIGN_ELEMENTS) -> list[int]:
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += -(-n // multiple) * multiple
    return offsets


def _trainable(named_params: Sequence[tuple[str, Parameter]], cfg: TrainConfig) -> list[tuple[str, Parameter]]:
    """The parameters that require grad, refused when the optimizer is not AdamW, a name repeats
    or none is left."""
    if cfg.optimizer != "adamw":
        raise ValueError(f"train.optimizer: mixed-precision master weights support adamw, got {cfg.optimizer!r}")
    named = [(n, p) for n, p in named_params if p.requires_grad]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("MasterWeightAdamW: parameter names must be unique")
    if not named:
        raise ValueError("MasterWeightAdamW: no trainable parameters")
    return named


class MasterWeightAdamW:
    """See the module docstring. Built from the model's fp32 parameters (their values are the
    masters), which it turns into bf16 views of its flat buffer (cast the module's other
    floating tensors yourself if you want them in bf16). The `trainer.optim.interface.Optimizer`
    interface; `zero1` shards the state over dp."""

    kind = "adamw"
    keeps_master = True

    def __init__(
        self,
        named_params: Sequence[tuple[str, Parameter]],
        cfg: TrainConfig,
        pc: ParallelContext,
        zero1: bool = False,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        compile: bool | None = None,
    ):
        named = _trainable(named_params, cfg)
        self.cfg, self.pc = cfg, pc
        self.zero1 = zero1 and pc.dp > 1
        self.bucket_numel = bucket_numel
        # The model's order: the gradient norm sums in it, so it does not depend on the layout.
        self.named_params = named
        self._lay_out(named)
        device = self.params[0].device
        self._flatten_params(device)
        # Main grads only where the step sums gradients; otherwise the update reads autograd's.
        self.main_grad: torch.Tensor | None = None
        if sums_gradients(cfg.micro_batches, pc.world_size):
            self.main_grad = torch.zeros_like(self.flat_params, dtype=torch.float32)
            for p, g in zip(self.params, self._views(self.main_grad)):
                attach_main_grad(p, g)
        self._init_state(device)
        self._build_kernels(device, compile)

    def _lay_out(self, named: list[tuple[str, Parameter]]) -> None:
        """Assigns dp owners and fixes the buffer order, this rank's span and its lr scales."""
        pc = self.pc
        owners = param_owners([p for _, p in named], pc.dp)
        for (_, p), o in zip(named, owners):
            set_dp_owner(p, o)
        groups = self._groups(named, owners)
        # Expert-parallel weights first in each group: a span of the flat buffer reduced over dp
        # never covers them, nor one reduced over their replica group the dense ones.
        self.layout = [x for _, g in groups for x in decay_first(sorted(g, key=_is_dense))]
        self.params = [p for _, p in self.layout]
        self.owners = [o for o, g in groups for _ in g]
        self.numels = [p.numel() for p in self.params]
        self.offsets = _aligned_offsets(self.numels)
        mine = pc.dp_rank if self.zero1 else 0
        self._first = sum(len(g) for _, g in groups[:mine])
        self.local = self.layout[self._first : self._first + len(groups[mine][1])]
        self._span = self._local_span()
        self.n_decay = self._decay_elements()
        # Per-parameter lr multipliers (muP, `trainer.optim.param_groups.lr_scale`): when they are
        # not all 1 the update runs per parameter, each with its own lr.
        self._lr_scales = [lr_scale(p) for _, p in self.local]
        self._uniform_lr = all(s == 1.0 for s in self._lr_scales)

    def _flatten_params(self, device: torch.device) -> None:
        """Turns the parameters into bf16 views of the flat buffer, their fp32 values split into
        the bf16 high halves and this rank's int16 remainders."""
        self.remainder = torch.zeros(self._span[1] - self._span[0], dtype=torch.int16, device=device)
        self.flat_params = torch.zeros(self.offsets[-1] + self.numels[-1], dtype=torch.bfloat16, device=device)
        # Every rank rounds every parameter as the update will (half away from zero), so that the
        # replicas agree before the owners' first broadcast.
        remainders = dict(zip(range(self._first, self._first + len(self.local)), self._local_views(self.remainder)))
        for i, (p, w) in enumerate(zip(self.params, self._views(self.flat_params))):
            split_fp32(p.detach().float(), w, remainders.get(i, torch.empty(p.shape, dtype=torch.int16, device=device)))
            p.data = w

    def _init_state(self, device: torch.device) -> None:
        """The AdamW moments of this rank's span, and lr, step and clip scale on the device."""
        self.exp_avg = torch.zeros(self._span[1] - self._span[0], dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self._lr = torch.tensor(self.cfg.lr, dtype=torch.float64, device=device)
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self._reduced = False
        self._combined: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None = None
        #: Steps whose update summed the caller's rows (`combine_gradients`): what a bench reports.
        self.combined_steps = 0

    def _build_kernels(self, device: torch.device, compile: bool | None) -> None:
        """The update kernel (compiled on CUDA by default) and, where autograd's gradients are
        read in place by Triton, the block table of this rank's parameters."""
        use_compile = device.type == "cuda" if compile is None else compile
        self._update: Callable[..., None] = (
            torch.compile(adamw_update, fullgraph=True, dynamic=False) if use_compile else adamw_update
        )
        self._blocks: TensorBlocks | None = None
        if self.main_grad is None and uses_triton(device):
            a = self._span[0]
            local = range(self._first, self._first + len(self.local))
            self._blocks = TensorBlocks.build(
                [self.offsets[i] - a for i in local], [self.numels[i] for i in local], device, BLOCK
            )
            self._coefficients = (
                torch.compile(stacked_coefficients, fullgraph=True, dynamic=False)
                if use_compile
                else stacked_coefficients
            )

    # -- layout -----------------------------------------------------------------------------
    def _groups(
        self, named: list[tuple[str, Parameter]], owners: list[int]
    ) -> list[tuple[int, list[tuple[str, Parameter]]]]:
        """(owner, its parameters) in buffer order: one group per dp rank under ZeRO-1, else
        one group of all (owner 0: every rank updates it; the owners set above still say who
        counts each parameter's norm)."""
        if not self.zero1:
            return [(0, named)]
        return [(r, [x for x, o in zip(named, owners) if o == r]) for r in range(self.pc.dp)]

    def _local_span(self) -> tuple[int, int]:
        """[start, end) of this rank's parameters in the flat buffers."""
        if not self.local:
            return (0, 0)
        last = self._first + len(self.local) - 1
        return self.offsets[self._first], self.offsets[last] + self.numels[last]

    def _decay_elements(self) -> int:
        """Elements of the local span that get weight decay: the matrices, which come first."""
        vectors = [i for i, (_, p) in enumerate(self.local) if p.ndim < 2]
        if not vectors:
            return self._span[1] - self._span[0]
        return self.offsets[self._first + vectors[0]] - self._span[0]

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view(p.shape) for p, o, n in zip(self.params, self.offsets, self.numels)]

    def _local_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Per local parameter, its view of a buffer of the local span (remainder, moments)."""
        a = self._span[0]
        idx = range(self._first, self._first + len(self.local))
        return [buf[self.offsets[i] - a : self.offsets[i] - a + self.numels[i]].view(self.params[i].shape) for i in idx]

    def _local(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self._span[0] : self._span[1]]

    # -- the step ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Sum the main grads over dp in fp32 (to the owners under ZeRO-1). Idempotent within
        a step; call after the tp/tied syncs."""
        if self._reduced:
            return
        reduce_grads(self.params, self.owners, self.pc, self.zero1, self.bucket_numel)
        self._reduced = True

    def combine_gradients(self, rows: dict[int, torch.Tensor], weights: torch.Tensor, norm: torch.Tensor) -> bool:
        """Take each parameter p's next gradient as sum_r weights[r] rows[id(p)][r] (rows [R,
        *p.shape], contiguous, in the parameters' dtype; weights [R]) without it being written:
        `step` sums the rows inside its kernel (`adamw_update_combined`: the sum in fp32 rounded
        once to the parameters' dtype, as a written gradient would be) and `clip_grad_norm`
        reports `norm`, the caller's global L2 norm of the sum, instead of reading gradients.
        DoGE's one-pass update (`trainer.run.alignment`): the k domain gradients read once here,
        not read to write the update that the norm and this step then read again. Taken only on
        the path that reads autograd's gradients with the Triton kernel (no main grads), at one
        lr and one process (nothing reduces or shards the gradients); returns whether it was
        taken, else the caller writes `.grad` as usual."""
        local = [p for _, p in self.local]
        if self._blocks is None or not self._uniform_lr or self.pc.world_size > 1 or not local:
            return False
        if any(id(p) not in rows for p in local):
            return False
        picked = [rows[id(p)] for p in local]
        r = weights.shape[0]
        fits = all(g.dtype == p.dtype and g.is_contiguous() and g.shape == (r, *p.shape) for g, p in zip(picked, local))
        rows_aligned = all(g[0].numel() * g.element_size() % ADDRESS_ALIGN == 0 for g in picked)
        if not fits or not aligned(picked) or not rows_aligned or not 1 <= r <= 16:
            return False
        self._combined = (picked, weights, norm)
        return True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient L2 norm (fp32 0-dim on the device, as `trainer.optim.clip`); when
        max_norm > 0 the next `step` scales the gradient by min(1, max_norm / (norm + 1e-6))."""
        self.reduce_gradients()
        if self._combined is not None:
            total = self._combined[2].to(torch.float32).reshape(())
        else:
            total = global_grad_norm(self.named_params, self.pc)
        if max_norm > 0:
            self._grad_scale = clip_coefficient(total, max_norm)
        return total

    def set_lr(self, lr: float) -> None:
        self._lr.fill_(lr)

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        self.reduce_gradients()
        if lr is not None:
            self.set_lr(lr)
        self._step += 1
        if self.local:
            if self.main_grad is not None:
                self._update_flat()
            else:
                self._update_from_autograd()
        if self.zero1:
            broadcast_from_owners(self.params, self.owners, self.pc, self.bucket_numel)
        self._grad_scale = torch.ones_like(self._grad_scale)
        self._reduced = False

    def _update_flat(self) -> None:
        c = self.cfg
        if not self._uniform_lr:
            self._update_each(self._local_views(self._local(self.main_grad)))
            return
        self._update(
            self.remainder,
            self._local(self.main_grad),
            self.exp_avg,
            self.exp_avg_sq,
            self._local(self.flat_params),
            self._lr,
            self._step,
            self._grad_scale,
            self.n_decay,
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
        )

    def _update_from_autograd(self) -> None:
        """The update on the local parameters' `.grad` (zero where a parameter got none): one
        Triton kernel where `uses_triton` (and the gradients are aligned, as autograd's are),
        else the flat update per parameter, eagerly (the CPU). After `combine_gradients`, the
        kernel sums each parameter's rows instead."""
        combined, self._combined = self._combined, None
        grads: list[torch.Tensor] = []
        if combined is None:
            for _, p in self.local:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for _, p in self.local]
            if self._blocks is None or not self._uniform_lr or not aligned(grads):
                self._update_each(grads)
                return
        c = self.cfg
        state = UpdateState(
            self.remainder,
            self.exp_avg,
            self.exp_avg_sq,
            self._local(self.flat_params),
            self._blocks,
            self._coefficients(self._lr, self._step, self._grad_scale, c.beta1, c.beta2, c.weight_decay),
            self.n_decay,
            c.beta1,
            c.beta2,
            c.eps,
        )
        if combined is None:
            adamw_update_tensors(state, grads)
        else:
            adamw_update_combined(state, combined[0], combined[1])
            self.combined_steps += 1

    def _update_each(self, grads: Sequence[torch.Tensor]) -> None:
        """The flat update per local parameter, eagerly, each with lr x its `_lr_scales` entry and
        the weight decay `scaled_weight_decay` gives for it (only matrices decay)."""
        c = self.cfg
        a = self._span[0]
        views = zip(
            self._local_views(self.remainder),
            self._local_views(self.exp_avg),
            self._local_views(self.exp_avg_sq),
            self._local_views(self._local(self.flat_params)),
        )
        local = range(self._first, self._first + len(self.local))
        for i, scale, g, (r, m, v, p) in zip(local, self._lr_scales, grads, views):
            decayed = p.numel() if self.offsets[i] - a < self.n_decay else 0
            adamw_update(
                r.view(-1),
                g.view(-1),
                m.view(-1),
                v.view(-1),
                p.view(-1),
                self._lr if scale == 1.0 else self._lr * scale,
                self._step,
                self._grad_scale,
                decayed,
                c.beta1,
                c.beta2,
                c.eps,
                scaled_weight_decay(c.weight_decay, scale),
            )

    def zero_grad(self) -> None:
        self._combined = None
        reset_main_grads(self.params)
        for p in self.params:
            p.grad = None
        self._reduced = False

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Master = the current bf16 parameters (remainders zero): call after loading model
        weights without an optimizer state (a fresh run initialised from a checkpoint)."""
        self.remainder.zero_()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters' fp32 masters by name (new tensors, joined from parameter and
        remainder)."""
        views = zip(self.local, self._local_views(self._local(self.flat_params)), self._local_views(self.remainder))
        return {name: join_fp32(p, r) for (name, _), p, r in views}

    def owned_names(self) -> list[str]:
        """Names of the parameters whose master and moments live on this rank."""
        return [n for n, _ in self.local]

    # -- state by name ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"kind": "adamw", "state": {name: {"step", "exp_avg", "exp_avg_sq", "master"}}}: torch
        AdamW's per-parameter keys plus the fp32 master, for this rank's parameters (empty before
        the first step, as torch's). The moments are views of the live buffers; the masters are
        joined into new tensors."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        if float(self._step) > 0:
            step = self._step.float().cpu()
            for (name, w), m, v in zip(
                self.master_weights().items(), self._local_views(self.exp_avg), self._local_views(self.exp_avg_sq)
            ):
                state[name] = {"step": step, "exp_avg": m, "exp_avg_sq": v, "master": w}
        return {"kind": "adamw", "state": state}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load this rank's parameters' state from `sd` (which may hold others' too). An empty
        state loads as fresh (master = the current parameters); otherwise every local parameter
        must be there. A state without "master" (saved by the fp32 optimizer) takes the master
        from the current, bf16, parameters: `trainer.checkpoint.checkpoint` supplies the saved fp32 ones."""
        if sd.get("kind") != "adamw":
            raise MasterWeightStateError(f"optimizer state is for {sd.get('kind')!r}, this optimizer is 'adamw'")
        state = sd["state"]
        if not state:
            self.refresh_master()
            return
        missing = [n for n, _ in self.local if n not in state]
        if missing:
            raise MasterWeightStateError(f"optimizer state has no entry for parameter {missing[0]!r}")
        steps = {float(state[n]["step"]) for n, _ in self.local}
        if len(steps) > 1:
            raise MasterWeightStateError(f"optimizer state: parameters are at different steps {sorted(steps)}")
        loaded = []
        for name, p in self.local:
            entry = state[name]
            keys = ("exp_avg", "exp_avg_sq", "master")
            srcs = [entry.get(key, p.detach() if key == "master" else None) for key in keys]
            for key, src in zip(keys, srcs):
                if src is None or tuple(src.shape) != tuple(p.shape):
                    got = None if src is None else tuple(src.shape)
                    raise MasterWeightStateError(
                        f"optimizer state {key!r} of parameter {name!r} has shape {got}, "
                        f"the parameter is {tuple(p.shape)}"
                    )
            loaded.append(srcs)
        views = zip(
            self._local_views(self.exp_avg),
            self._local_views(self.exp_avg_sq),
            self._local_views(self._local(self.flat_params)),
            self._local_views(self.remainder),
        )
        for (exp_avg, exp_avg_sq, master), (m, v, p, r) in zip(loaded, views):
            m.copy_(exp_avg)
            v.copy_(exp_avg_sq)
            split_fp32(master.float().contiguous(), p, r)
        if steps:
            self._step.fill_(steps.pop())
