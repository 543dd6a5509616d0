"""Model shapes by name.

The DoReMi paper's shapes (Xie et al. 2023, Appendix, Table of architectures: 256k vocabulary,
head dimension 64) and the Llama-3 8B / 70B shapes (Meta, 2024). `tiny` is for tests.
Hybrid Mamba-2 / attention stacks (`model.block_pattern`, trainer/config/mamba.py):
`hybrid-tiny` for tests, `hybrid-quickstart` at the quickstart's scale, `hybrid-1b` for a GPU
(3 Mamba-2 layers per attention layer, as in Waleffe et al. 2024's hybrids; ~1.08B parameters).
Mixture-of-experts (`model.moe`, trainer/model/moe.py): `moe-tiny` for tests and the quickstart,
`moe-1b-active` for the GPU bench (8 experts of 2048, top-2, one shared expert: ~1.0B active of
~2.6B parameters).
"""

from __future__ import annotations

LLAMA3_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256),
    "doremi-70m": dict(
        vocab_size=256000,
        d_model=256,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=1024,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "doremi-150m": dict(
        vocab_size=256000,
        d_model=512,
        n_layers=6,
        n_heads=8,
        n_kv_heads=8,
        ffn_dim=2048,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "doremi-280m": dict(
        vocab_size=256000,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=3072,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "doremi-510m": dict(
        vocab_size=256000,
        d_model=1024,
        n_layers=12,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=8192,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "doremi-760m": dict(
        vocab_size=256000,
        d_model=1280,
        n_layers=12,
        n_heads=20,
        n_kv_heads=20,
        ffn_dim=8192,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "doremi-1b": dict(
        vocab_size=256000,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=8192,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # The bench baseline's shapes (experiments/tools/bench/plain_llama.py `1b`, `280m`).
    "bench-1b": dict(
        vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048
    ),
    "bench-280m": dict(
        vocab_size=32000, d_model=1024, n_layers=18, n_heads=16, n_kv_heads=16, ffn_dim=2816, max_seq_len=1024
    ),
    "moe-tiny": dict(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=256,
        moe=dict(num_experts=4, top_k=2, expert_ffn_dim=64),
    ),
    "moe-1b-active": dict(
        vocab_size=32000,
        d_model=2048,
        n_layers=20,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=5632,
        max_seq_len=2048,
        moe=dict(num_experts=8, top_k=2, expert_ffn_dim=2048, shared_experts=1),
    ),
    "hybrid-tiny": dict(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=256,
        block_pattern="MA",
        mamba=dict(d_state=16, head_dim=16, ngroups=2, chunk_size=8),
    ),
    "hybrid-quickstart": dict(
        vocab_size=2048,
        d_model=96,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        max_seq_len=64,
        block_pattern="MA",
        mamba=dict(d_state=16, head_dim=32, ngroups=2, chunk_size=16),
    ),
    "hybrid-1b": dict(
        vocab_size=32000,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=5632,
        max_seq_len=2048,
        block_pattern="MMMA",
        mamba=dict(d_state=128, head_dim=64, ngroups=8, chunk_size=256),
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        rope_scaling=LLAMA3_ROPE_SCALING,
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        rope_scaling=LLAMA3_ROPE_SCALING,
    ),
}
