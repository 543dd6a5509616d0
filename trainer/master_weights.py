"""Mixed-precision AdamW: bf16 model parameters, fp32 master weights and moments in the optimizer
(Micikevicius et al. 2018, "Mixed Precision Training", with bf16 so no loss scaling; the layout of
Megatron-LM's distributed optimizer, here without its dp sharding).

Why: fp32 parameters under bf16 autocast cast every weight to bf16 in each forward, turn every
bf16 weight gradient into fp32 in backward and run AdamW over fp32 parameters: about 52 bytes
of memory traffic per parameter per step with clipping. Pure bf16 parameters updated in bf16
(the plain baseline) are cheaper (14 bytes) but round every update to 8 mantissa bits, so small
updates vanish. Here the model runs on bf16 parameters and the optimizer owns the fp32 truth.

Layout: the trainable parameters, matrices first and then vectors (the weight-decay groups of
`trainer.optim`), become views into one flat bf16 buffer; the fp32 master copy and the AdamW
moments are flat fp32 buffers in the same order. Per step:
- `reduce_gradients`: the bf16 gradients that autograd left in `.grad` are copied into one flat
  buffer (one multi-tensor copy), summed over dp in fp32 (one all-reduce) when dp > 1;
- `clip_grad_norm`: the global L2 norm from per-parameter norms of that buffer (one read; the
  parameters counted follow `trainer.parallel.clip`), and the clip coefficient, both on device;
- `step(lr)`: one fused elementwise kernel (torch.compile on CUDA) that scales the gradient by
  the clip coefficient, applies torch.optim.AdamW's update (decoupled weight decay on matrices
  only, bias corrections) to the fp32 master and writes its bf16 rounding into the parameters.
Traffic: 4 (copy) + 2 (norm) + 28 (update) = 34 bytes per parameter. lr and the step count live
on the device, so a step has no host synchronisation.

Limits of this first pass: no ZeRO-1 (the state is replicated over dp), and micro-batch
gradients accumulate in bf16 in `.grad` (fp32 accumulation is an open item, see
experiments/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn import Parameter

from trainer.config import TrainConfig
from trainer.parallel.clip import counts_here
from trainer.parallel.context import ParallelContext


#: Each parameter's view starts at a multiple of this many elements (128 bytes in bf16): compiled
#: kernels assume aligned inputs and copy misaligned ones. The gaps stay zero in every buffer.
ALIGN_ELEMENTS = 64


class MasterWeightStateError(ValueError):
    """An optimizer state that does not fit this optimizer: one line naming the parameter."""


def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 param: torch.Tensor, lr: torch.Tensor, step: torch.Tensor, grad_scale: torch.Tensor,
                 n_decay: int, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """In place on flat buffers: AdamW (Loshchilov & Hutter 2019) as torch.optim.AdamW computes it,
    on the fp32 `master` with gradient `grad * grad_scale`; weight decay on the first `n_decay`
    elements only; then `param` (bf16) = master rounded. `step` is the step number after this
    update (1 on the first); lr and step are 0-dim float64 tensors."""
    g = grad.float() * grad_scale
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = (lr / (1.0 - beta1 ** step)).float()
    bias_correction2_sqrt = (1.0 - beta2 ** step).sqrt().float()
    decayed = torch.arange(master.numel(), device=master.device) < n_decay
    keep = torch.where(decayed, (1.0 - lr * weight_decay).float(), 1.0)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    master.mul_(keep).sub_(step_size * exp_avg / denom)
    param.copy_(master)


def _aligned_offsets(numels: Sequence[int], multiple: int = ALIGN_ELEMENTS) -> list[int]:
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += -(-n // multiple) * multiple
    return offsets


def _ordered(named: Sequence[tuple[str, Parameter]]) -> list[tuple[str, Parameter]]:
    return [x for x in named if x[1].ndim >= 2] + [x for x in named if x[1].ndim < 2]


class MasterWeightAdamW:
    """See the module docstring. Built from the model's fp32 parameters, which it turns into bf16
    views of its flat buffer (cast the module's other floating tensors yourself if you want them
    in bf16). Same per-step interface as `trainer.optim.ShardedOptimizer`, plus `clip_grad_norm`."""

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], cfg: TrainConfig, pc: ParallelContext,
                 param_dtype: torch.dtype = torch.bfloat16, compile: bool | None = None):
        if cfg.optimizer != "adamw":
            raise ValueError(f"train.optimizer: mixed-precision master weights support adamw, got {cfg.optimizer!r}")
        named = _ordered([(n, p) for n, p in named_params if p.requires_grad])
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("MasterWeightAdamW: parameter names must be unique")
        if not named:
            raise ValueError("MasterWeightAdamW: no trainable parameters")
        self.cfg, self.pc = cfg, pc
        self.named_params = named
        self.params = [p for _, p in named]
        device = self.params[0].device
        self.numels = [p.numel() for p in self.params]
        self.offsets = _aligned_offsets(self.numels)
        total = self.offsets[-1] + self.numels[-1]
        n_matrices = sum(p.ndim >= 2 for p in self.params)
        self.n_decay = self.offsets[n_matrices] if n_matrices < len(self.params) else total
        self.master = torch.zeros(total, dtype=torch.float32, device=device)
        for p, view in zip(self.params, self._views(self.master)):
            view.copy_(p.detach())
        self.flat_params = self.master.to(param_dtype)
        for p, view in zip(self.params, self._views(self.flat_params)):
            p.data = view
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.flat_grad = torch.zeros(total, dtype=param_dtype, device=device)
        self._lr = torch.tensor(cfg.lr, dtype=torch.float64, device=device)
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self._counted = torch.tensor([float(counts_here(n, p, pc)) for n, p in named], device=device)
        self._reduced: torch.Tensor | None = None
        use_compile = device.type == "cuda" if compile is None else compile
        self._update: Callable[..., None] = (torch.compile(adamw_update, fullgraph=True, dynamic=False)
                                             if use_compile else adamw_update)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(p.shape) for p, o, n in zip(self.params, self.offsets, self.numels)]

    # -- the step ---------------------------------------------------------------------------
    def reduce_gradients(self) -> torch.Tensor:
        """The step's gradient as one flat buffer (bf16, or fp32 summed over dp when dp > 1).
        Idempotent within a step."""
        if self._reduced is not None:
            return self._reduced
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        torch._foreach_copy_(self._views(self.flat_grad), grads)
        flat = self.flat_grad
        if self.pc.dp > 1:
            flat = flat.float()
            dist.all_reduce(flat, group=self.pc.dp_group)
        self._reduced = flat
        return flat

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient L2 norm (fp32 0-dim on the device, as `trainer.parallel.clip`); when
        max_norm > 0 the next `step` scales the gradient by min(1, max_norm / (norm + 1e-6))."""
        flat = self.reduce_gradients()
        norms = torch._foreach_norm([flat[o:o + n] for o, n in zip(self.offsets, self.numels)], 2,
                                    dtype=torch.float32)
        sq = (torch.stack(norms).square() * self._counted).sum()
        if self.pc.world_size > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        total = sq.sqrt()
        if max_norm > 0:
            self._grad_scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        return total

    def set_lr(self, lr: float) -> None:
        self._lr.fill_(lr)

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        grad = self.reduce_gradients()
        if lr is not None:
            self.set_lr(lr)
        self._step += 1
        c = self.cfg
        self._update(self.master, grad, self.exp_avg, self.exp_avg_sq, self.flat_params, self._lr, self._step,
                     self._grad_scale, self.n_decay, c.beta1, c.beta2, c.eps, c.weight_decay)
        self._grad_scale = torch.ones_like(self._grad_scale)
        self._reduced = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._reduced = None

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Master = the current bf16 parameters: call after loading model weights without an
        optimizer state (a fresh run initialised from a checkpoint)."""
        for p, w in zip(self.params, self._views(self.master)):
            w.copy_(p)

    def owned_names(self) -> list[str]:
        return [n for n, _ in self.named_params]

    # -- state by name ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"kind": "adamw", "state": {name: {"step", "exp_avg", "exp_avg_sq", "master"}}}: torch
        AdamW's per-parameter keys plus the fp32 master, views of the live buffers."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        if float(self._step) > 0:
            for (name, _), m, v, w in zip(self.named_params, self._views(self.exp_avg),
                                          self._views(self.exp_avg_sq), self._views(self.master)):
                state[name] = {"step": self._step.float().cpu(), "exp_avg": m, "exp_avg_sq": v, "master": w}
        return {"kind": "adamw", "state": state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """An empty state loads as fresh (master = the current parameters); otherwise every
        parameter must be there. A state without "master" (saved by the fp32 optimizer) takes
        the master from the current parameters."""
        if sd.get("kind") != "adamw":
            raise MasterWeightStateError(f"optimizer state is for {sd.get('kind')!r}, this optimizer is 'adamw'")
        state = sd["state"]
        if not state:
            return
        missing = [n for n, _ in self.named_params if n not in state]
        if missing:
            raise MasterWeightStateError(f"optimizer state has no entry for parameter {missing[0]!r}")
        steps = {float(state[n]["step"]) for n, _ in self.named_params}
        if len(steps) != 1:
            raise MasterWeightStateError(f"optimizer state: parameters are at different steps {sorted(steps)}")
        for (name, p), m, v, w in zip(self.named_params, self._views(self.exp_avg), self._views(self.exp_avg_sq),
                                      self._views(self.master)):
            entry = state[name]
            for key, dst in (("exp_avg", m), ("exp_avg_sq", v), ("master", w)):
                src = entry.get(key, p.detach() if key == "master" else None)
                if src is None or tuple(src.shape) != tuple(p.shape):
                    got = None if src is None else tuple(src.shape)
                    raise MasterWeightStateError(f"optimizer state {key!r} of parameter {name!r} has shape {got}, "
                                                 f"the parameter is {tuple(p.shape)}")
                dst.copy_(src)
        self._step.fill_(steps.pop())
        self.flat_params.copy_(self.master)
