"""Parameter and FLOP counts of the Llama model, by formula (no model needed).

Convention (that of experiments/tools/bench/plain_llama.py, so MFU compares like for like):
FLOPs per token = 6 * N + 6 * L * d * s, where N is every parameter except the input embedding
(the LM head's V x d counted even when tied, since its matmul runs; norm weights included) and
6 * L * d * s is attention's QK^T and AV (2 matmuls x 2 FLOPs x d x s per token, x3 for forward
+ backward) with causal masking counted half, as Megatron does. Unpadded vocabulary;
recomputation not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations


def layer_params(cfg) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d
    mlp = 3 * d * cfg.ffn_dim
    return attn + mlp + 2 * d


def param_count(cfg) -> int:
    """Distinct trainable parameters (tied embeddings counted once)."""
    vd = cfg.vocab_size * cfg.d_model
    return vd + (0 if cfg.tie_embeddings else vd) + cfg.n_layers * layer_params(cfg) + cfg.d_model


def non_embedding_params(cfg) -> int:
    """Parameters that take part in matmuls per token: blocks, final norm and the LM head."""
    return cfg.n_layers * layer_params(cfg) + cfg.d_model + cfg.vocab_size * cfg.d_model


def attention_flops_per_token(cfg, seq_len: int) -> int:
    return 6 * cfg.n_layers * cfg.d_model * seq_len


def flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    return 6 * non_embedding_params(cfg) + attention_flops_per_token(cfg, seq_len)
