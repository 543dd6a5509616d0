"""The optimizer of one rank: AdamW or Adafactor, plain data parallel or ZeRO-1, state by name.

Two implementations behind one interface (`Optimizer`), chosen by `build_optimizer` from the
resolved parameter dtype (`trainer.build.param_dtype`, train.param_dtype in the config):
- fp32 parameters: `ShardedOptimizer` (here), a torch AdamW or Adafactor;
- bf16 parameters: `trainer.master_weights.MasterWeightAdamW`, fp32 main grads, fp32 master
  weights and moments, one fused update (AdamW only).
Both shard their state over dp with ZeRO-1 by the same owner partition
(`trainer.parallel.data.partition_params`), which is also what clipping counts by.

Per step: `reduce_gradients()` (dp sum, once, after every micro-batch's backward and the tp/tied
syncs; `step` calls it if the caller did not), `clip_grad_norm(max_norm)` (the global norm as a
device tensor, `trainer.parallel.clip`), `step(lr)` (the update, then under ZeRO-1 the owners
broadcast the updated parameters), `zero_grad()`.

`ShardedOptimizer` wraps a torch optimizer over the parameters whose update this rank computes:
all of them without ZeRO-1, the ones it owns with ZeRO-1 (`trainer.parallel.data`).

Weight decay applies to matrices only, not to norms or biases (1-D parameters). AdamW is fused
when the parameters are on CUDA, foreach otherwise. Adafactor is `torch.optim.Adafactor`
(Shazeer & Stern 2018 as implemented in torch >= 2.5: relative step min(lr, 1/sqrt(t)) scaled by
max(eps2, RMS(param)), factored second moment for >= 2-D parameters, no first moment); under
tp > 1 its factored statistics and parameter RMS are those of the tp-local shard.

`state_dict()` is keyed by parameter name, holding only this rank's state (the owned parameters
under ZeRO-1), so a checkpoint can regroup it under any other layout. The AdamW keys ("step",
"exp_avg", "exp_avg_sq") are torch's in both implementations; the bf16 one adds "master", so
either loads the other's state (`trainer.checkpoint` moves the master into fp32 parameters,
and fp32 parameters into the master).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch.nn import Parameter

from trainer.config import TrainConfig
from trainer.parallel.clip import clip_grad_norm
from trainer.parallel.context import ParallelContext
from trainer.parallel.data import (DEFAULT_BUCKET_NUMEL, broadcast_from_owners, partition_params, reduce_grads,
                                   set_dp_owner)


class OptimizerStateError(ValueError):
    """An optimizer state that does not fit this optimizer: one line naming the parameter."""


class Optimizer(Protocol):
    """What the training loop and the checkpoints use of an optimizer."""

    kind: str  # "adamw" | "adafactor": the state's format
    zero1: bool  # the state is sharded over dp (each rank writes its own)
    keeps_master: bool  # the state holds an fp32 "master" of each (lower-precision) parameter

    def reduce_gradients(self) -> Any: ...
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor: ...
    def step(self, lr: float | None = None) -> None: ...
    def zero_grad(self) -> None: ...
    def owned_names(self) -> list[str]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def _param_groups(named: Sequence[tuple[str, Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def decay_first(named: Sequence[tuple[str, Parameter]]) -> list[tuple[str, Parameter]]:
    """Matrices (weight decay) then vectors (none): the order of `_param_groups`, which is that
    of the indices of torch's state_dict, and the two contiguous decay regions of a flat buffer."""
    return [x for x in named if x[1].ndim >= 2] + [x for x in named if x[1].ndim < 2]


def _torch_optimizer(named: Sequence[tuple[str, Parameter]], cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = _param_groups(named, cfg.weight_decay)
    on_cuda = all(p.device.type == "cuda" for _, p in named)
    if cfg.optimizer == "adamw":
        accel = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **accel)
    if cfg.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    raise ValueError(f"train.optimizer: expected adamw or adafactor, got {cfg.optimizer!r}")


class ShardedOptimizer:
    """See the module docstring. `zero1` shards the optimizer state over dp (no-op at dp=1)."""

    keeps_master = False

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], cfg: TrainConfig, pc: ParallelContext,
                 zero1: bool, bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            raise ValueError("build_optimizer: parameter names must be unique")
        self.kind = cfg.optimizer
        self.pc = pc
        self.zero1 = zero1 and pc.dp > 1
        self.bucket_numel = bucket_numel
        self.named_params = list(named_params)
        self.params = [p for _, p in self.named_params]
        self.owners = partition_params([p.numel() for p in self.params], pc.dp)
        for p, o in zip(self.params, self.owners):
            set_dp_owner(p, o)
        if self.zero1:
            local = [(n, p) for (n, p), o in zip(self.named_params, self.owners) if o == pc.dp_rank]
        else:
            local = self.named_params
        self.local = decay_first(local)
        self.inner = _torch_optimizer(self.local, cfg) if self.local else None
        self._reduced = False

    # -- the step ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Sum gradients over dp (to the owners under ZeRO-1). Idempotent within a step."""
        if self._reduced:
            return
        reduce_grads(self.params, self.owners, self.pc, self.zero1, self.bucket_numel)
        self._reduced = True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (device tensor); clips the gradients in place when max_norm > 0."""
        self.reduce_gradients()
        return clip_grad_norm(self.named_params, max_norm, self.pc)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        self.reduce_gradients()
        if lr is not None:
            self.set_lr(lr)
        if self.inner is not None:
            for _, p in self.local:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.inner.step()
        if self.zero1:
            broadcast_from_owners(self.params, self.owners, self.pc, self.bucket_numel)
        self._reduced = False

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._reduced = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups if self.inner is not None else []

    def owned_names(self) -> list[str]:
        """Names of the parameters whose optimizer state lives on this rank."""
        return [n for n, _ in self.local]

    # -- state by name ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"kind": "adamw" | "adafactor", "state": {name: {key: tensor}}} for this rank's
        parameters (references to the live tensors, as torch's own `state_dict`)."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        if self.inner is not None:
            for name, p in self.local:
                if self.inner.state.get(p):
                    state[name] = dict(self.inner.state[p])
        return {"kind": self.kind, "state": state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load the state of this rank's parameters from `sd` (which may hold others' too). An empty
        state (a fresh optimizer) loads as fresh; otherwise every local parameter must be there.
        A "master" (from the bf16 optimizer) is not state here: it is the parameter itself, which
        `trainer.checkpoint` loads from it."""
        if sd.get("kind") != self.kind:
            raise OptimizerStateError(f"optimizer state is for {sd.get('kind')!r}, this optimizer is {self.kind!r}")
        state = {n: {k: v for k, v in s.items() if k != "master"} for n, s in sd["state"].items()}
        if self.inner is None or not state:
            return
        missing = [n for n, _ in self.local if n not in state]
        if missing:
            raise OptimizerStateError(f"optimizer state has no entry for parameter {missing[0]!r}")
        for name, p in self.local:
            for key, t in state[name].items():
                if t.ndim and (t.ndim != p.ndim or any(a not in (b, 1) for a, b in zip(t.shape, p.shape))):
                    raise OptimizerStateError(
                        f"optimizer state {key!r} of parameter {name!r} has shape {tuple(t.shape)}, "
                        f"the parameter is {tuple(p.shape)}")
        torch_sd = self.inner.state_dict()
        torch_sd["state"] = {i: dict(state[name]) for i, (name, _) in enumerate(self.local)}
        self.inner.load_state_dict(torch_sd)


def build_optimizer(named_params: Sequence[tuple[str, Parameter]], cfg: TrainConfig, pc: ParallelContext,
                    zero1: bool, param_dtype: torch.dtype = torch.float32,
                    bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> Optimizer:
    """The optimizer for this rank's trainable parameters (global names, tp-local tensors).
    `param_dtype` bf16 turns the (fp32) parameters into bf16 views of the master-weight
    optimizer's flat buffer; build it before anything else captures the parameters' storage."""
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    if param_dtype == torch.float32:
        return ShardedOptimizer(trainable, cfg, pc, zero1, bucket_numel)
    if param_dtype != torch.bfloat16:
        raise ValueError(f"build_optimizer: parameters are trained in fp32 or bf16, got {param_dtype}")
    # Imported here: trainer.master_weights builds on this module's helpers.
    from trainer.master_weights import MasterWeightAdamW

    return MasterWeightAdamW(trainable, cfg, pc, zero1=zero1, bucket_numel=bucket_numel)
