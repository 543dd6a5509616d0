"""`ShardedOptimizer`: a torch AdamW or Adafactor over the parameters whose update this rank
computes (all of them, or its ZeRO-1 share); the fp32-parameter optimizer of `trainer.optim`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import Parameter

from trainer.config.schema import TrainConfig
from trainer.optim.clip import clip_grad_norm
from trainer.optim.interface import OptimizerStateError
from trainer.optim.param_groups import decay_first, param_groups
from trainer.parallel.context import ParallelContext
from trainer.parallel.data_parallel import (
    DEFAULT_BUCKET_NUMEL,
    broadcast_from_owners,
    param_owners,
    reduce_grads,
    set_dp_owner,
)


def _torch_optimizer(named: Sequence[tuple[str, Parameter]], cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(named, cfg.weight_decay)
    for g in groups:
        g["lr"] = cfg.lr * g["lr_scale"]
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

    def __init__(
        self,
        named_params: Sequence[tuple[str, Parameter]],
        cfg: TrainConfig,
        pc: ParallelContext,
        zero1: bool,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    ):
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            raise ValueError("build_optimizer: parameter names must be unique")
        self.kind = cfg.optimizer
        self.pc = pc
        self.zero1 = zero1 and pc.dp > 1
        self.bucket_numel = bucket_numel
        self.named_params = list(named_params)
        self.params = [p for _, p in self.named_params]
        self.owners = param_owners(self.params, pc.dp)
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

    def combine_gradients(self, rows: dict[int, torch.Tensor], weights: torch.Tensor, norm: torch.Tensor) -> bool:
        """Never: torch's optimizers read `.grad` (`MasterWeightAdamW.combine_gradients`)."""
        return False

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (device tensor); clips the gradients in place when max_norm > 0."""
        self.reduce_gradients()
        return clip_grad_norm(self.named_params, max_norm, self.pc)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)

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
        `trainer.checkpoint.checkpoint` loads from it."""
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
                        f"the parameter is {tuple(p.shape)}"
                    )
        torch_sd = self.inner.state_dict()
        torch_sd["state"] = {i: dict(state[name]) for i, (name, _) in enumerate(self.local)}
        self.inner.load_state_dict(torch_sd)
