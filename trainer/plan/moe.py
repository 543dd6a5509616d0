"""What MoE blocks add to a rank's memory (`doremi plan`, `trainer.plan.memory`), on top of the dense
model's accounting (`trainer.plan.cost_model`), which counts every block with a dense SwiGLU.

Per MoE block on one rank: the router (E x d, replicated), this rank's E / ep routed experts (each
3 d F split over tp), the shared experts (3 d F x shared, split over tp), minus the dense SwiGLU
the block does not have. Expert weights' ZeRO-1 state is sharded over their replica group
(dp / ep ranks, `trainer.parallel.expert`), the rest over dp. All-to-all buffers (ep > 1): one
block's dispatch and combine, each a send and a receive of the T k assignments (T tokens of the
micro-batch on the rank), d wide in the activation dtype; short-lived, one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.plan.cost_model import bytes_per_param


@dataclass(frozen=True)
class MoEMemory:
    """Bytes one rank of a stage holds for its MoE blocks beyond the dense accounting."""

    blocks: int
    expert_params: int  # this rank's routed experts
    params_delta: int  # all MoE parameters minus the dense SwiGLUs they replace
    weights: float
    grads: float
    optimizer: float
    all_to_all: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.all_to_all


def moe_stage_memory(
    model,
    par,
    layers: range,
    micro_batch_size: int,
    seq_len: int,
    param_precision: str,
    optimizer: str = "adamw",
) -> MoEMemory | None:
    moe = getattr(model, "moe", None)
    if moe is None:
        return None
    blocks = len([i for i in moe.moe_layers(model.n_layers) if i in layers])
    tp, dp, ep = par.tp, par.dp, getattr(par, "ep", 1)
    d, f = model.d_model, moe.ffn_dim(model.ffn_dim)
    experts = blocks * (moe.num_experts // ep) * 3 * d * f // tp
    other = blocks * (moe.num_experts * d + moe.shared_experts * 3 * d * f // tp)
    dense = blocks * 3 * d * model.ffn_dim // tp
    opt = "adamw" if optimizer not in ("adamw", "adafactor") else optimizer
    dense_bytes = bytes_per_param(param_precision, dp, par.zero1, optimizer=opt)
    expert_bytes = bytes_per_param(param_precision, max(1, dp // ep), par.zero1, optimizer=opt)
    delta = other - dense
    act = 2.0  # bf16 compute on the GPUs `doremi plan` plans for
    tokens = micro_batch_size * seq_len
    a2a = 4.0 * tokens * moe.top_k * d * act if ep > 1 and blocks else 0.0
    return MoEMemory(
        blocks=blocks,
        expert_params=experts,
        params_delta=experts + delta,
        weights=experts * expert_bytes.weight + delta * dense_bytes.weight,
        grads=experts * expert_bytes.grad + delta * dense_bytes.grad,
        optimizer=experts * expert_bytes.optimizer + delta * dense_bytes.optimizer,
        all_to_all=a2a,
    )
