"""The `model.moe` config section: which blocks hold a mixture of SwiGLU experts, and how tokens
are routed (`trainer.model.moe`). A plain dataclass (no torch), so `trainer.config.schema` can hold it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.config.tools import ConfigError


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (Shazeer et al. 2017; Switch, Fedus et al. 2022; GShard, Lepikhin
    et al. 2021; ST-MoE, Zoph et al. 2022), dropless (MegaBlocks, Gale et al. 2023)."""

    # Routed experts per MoE block.
    num_experts: int = 8
    # Experts each token is sent to.
    top_k: int = 2
    # Hidden size of each expert's SwiGLU; None: model.ffn_dim.
    expert_ffn_dim: int | None = None
    # Always-on shared experts (DeepSeekMoE, Dai et al. 2024), each of expert_ffn_dim, fused into one SwiGLU.
    shared_experts: int = 0
    # Blocks (global indices) whose MLP is a mixture; empty: every block.
    layers: list[int] = field(default_factory=list)
    # Router scores: `softmax` over the experts, or `sigmoid` per expert (DeepSeek-V3).
    gating: Literal["softmax", "sigmoid"] = "softmax"
    # Rescale the top-k scores of a token to sum to one (always on for sigmoid gating; never with
    # softmax and top_k 1, where it would make every weight 1 and cut the router off the loss).
    normalize_top_k: bool = True
    # Coefficient of the load-balancing loss num_experts * sum_e f_e P_e, per sequence (see trainer.model.moe).
    aux_loss_coef: float = 0.01
    # Coefficient of the router z-loss, mean over tokens of logsumexp(router logits)^2 (ST-MoE).
    z_loss_coef: float = 0.001

    def moe_layers(self, n_layers: int) -> list[int]:
        return sorted(self.layers) if self.layers else list(range(n_layers))

    def ffn_dim(self, model_ffn_dim: int) -> int:
        return self.expert_ffn_dim or model_ffn_dim

    def validate(self, path: str = "model.moe") -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{path}.num_experts: expected >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{path}.top_k: expected 1 <= top_k <= num_experts={self.num_experts}, got {self.top_k}")
        if self.gating == "sigmoid" and self.top_k == 1:
            raise ConfigError(
                f"{path}.top_k: sigmoid gating rescales the top-k scores to sum to one, so with top_k=1 every "
                "weight is 1 and the router learns nothing from the loss; expected top_k >= 2, or gating: softmax"
            )
        if self.expert_ffn_dim is not None and self.expert_ffn_dim < 1:
            raise ConfigError(f"{path}.expert_ffn_dim: expected a positive int or null, got {self.expert_ffn_dim}")
        if self.shared_experts < 0:
            raise ConfigError(f"{path}.shared_experts: expected >= 0, got {self.shared_experts}")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ConfigError(
                f"{path}: expected aux_loss_coef >= 0 and z_loss_coef >= 0, "
                f"got {self.aux_loss_coef} and {self.z_loss_coef}"
            )
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"{path}.layers: expected distinct block indices, got {self.layers}")


def check_moe_layout(moe: MoEConfig | None, n_layers: int, model_ffn_dim: int, tp: int, dp: int, ep: int) -> None:
    """The one-line errors for a MoE config that the layout cannot run."""
    if ep < 1:
        raise ConfigError(f"parallelism.ep: expected >= 1, got {ep}")
    if moe is None:
        if ep > 1:
            raise ConfigError(f"parallelism.ep: expert parallelism needs model.moe, got ep={ep} and no model.moe")
        return
    bad = [i for i in moe.layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"model.moe.layers: expected block indices in [0, {n_layers}), got {bad}")
    if dp % ep:
        raise ConfigError(f"parallelism.ep: expected a divisor of parallelism.dp={dp}, got {ep}")
    if moe.num_experts % ep:
        raise ConfigError(f"parallelism.ep: expected a divisor of model.moe.num_experts={moe.num_experts}, got {ep}")
    if moe.ffn_dim(model_ffn_dim) % tp:
        raise ConfigError(
            f"parallelism.tp: expected a divisor of the expert hidden size {moe.ffn_dim(model_ffn_dim)}, got {tp}"
        )


def moe_mlp_params(cfg, active: bool) -> int:
    """One MoE block's MLP parameters (model `cfg` with `moe`): all of them (`active` False), or
    those a token computes with (top-k and shared experts' SwiGLUs, the router)."""
    moe: MoEConfig = cfg.moe
    d, f = cfg.d_model, moe.ffn_dim(cfg.ffn_dim)
    experts = (moe.top_k if active else moe.num_experts) + moe.shared_experts
    return experts * 3 * d * f + moe.num_experts * d


def moe_params_delta(cfg, active: bool) -> int:
    """Parameters the MoE blocks of model `cfg` have beyond the dense SwiGLUs they replace: all
    of them (`active` False), or those a token computes with (`moe_mlp_params`)."""
    moe: MoEConfig | None = getattr(cfg, "moe", None)
    if moe is None:
        return 0
    per_block = moe_mlp_params(cfg, active) - 3 * cfg.d_model * cfg.ffn_dim
    return len(moe.moe_layers(cfg.n_layers)) * per_block
