"""Parameter and FLOP counts of the Llama model, by formula (no model needed).

Convention (that of experiments/tools/bench/plain_llama.py, so MFU compares like for like):
FLOPs per token = 6 * N + 6 * L * d * s, where N is every parameter except the input embedding
(the LM head's V x d counted even when tied, since its matmul runs; norm weights included) and
6 * L * d * s is attention's QK^T and AV (2 matmuls x 2 FLOPs x d x s per token, x3 for forward
+ backward) with causal masking counted half, as Megatron does. Unpadded vocabulary;
recomputation not counted (model FLOPs, not hardware FLOPs).

Hybrid stacks (`model.block_pattern`): N counts each layer's own parameters (a Mamba-2 layer's
mixer by `trainer.config.mamba.mamba_mixer_params`), attention's 6 d s only for attention
layers, and each Mamba-2 layer adds its chunked scan, `ssd_flops_per_token`.
"""

from __future__ import annotations

from trainer.config.mamba import mamba_mixer_params, n_mamba_layers, ssd_flops_per_token
from trainer.config.moe import moe_params_delta


def attention_params(cfg) -> int:
    """One attention mixer's: the fused q, k, v projection and the output projection."""
    d, hd = cfg.d_model, cfg.head_dim
    return d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d


def layer_params(cfg) -> int:
    d = cfg.d_model
    return attention_params(cfg) + 3 * d * cfg.ffn_dim + 2 * d


def blocks_params(cfg) -> int:
    """Every block's parameters: attention blocks `layer_params`, Mamba-2 blocks their mixer
    instead of attention's."""
    mamba = n_mamba_layers(cfg)
    return cfg.n_layers * layer_params(cfg) + mamba * (mamba_mixer_params(cfg) - attention_params(cfg))


def param_count(cfg) -> int:
    """Distinct trainable parameters (tied embeddings counted once)."""
    vd = cfg.vocab_size * cfg.d_model
    return vd + (0 if cfg.tie_embeddings else vd) + blocks_params(cfg) + cfg.d_model + moe_params_delta(cfg, False)


def non_embedding_params(cfg) -> int:
    """Parameters that take part in matmuls per token: blocks (MoE blocks: their router, top-k
    and shared experts), final norm and the LM head."""
    return blocks_params(cfg) + cfg.d_model + cfg.vocab_size * cfg.d_model + moe_params_delta(cfg, True)


def attention_flops_per_token(cfg, seq_len: int) -> int:
    return 6 * (cfg.n_layers - n_mamba_layers(cfg)) * cfg.d_model * seq_len


def flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    scan = n_mamba_layers(cfg) * ssd_flops_per_token(cfg) if n_mamba_layers(cfg) else 0
    return 6 * non_embedding_params(cfg) + attention_flops_per_token(cfg, seq_len) + scan
