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

#: The columns of a preset's row: every model family sets these (trainer/config/schema.py ModelConfig).
SHAPE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
#: What a family adds to its rows: the DoReMi paper ties the embeddings; Llama 3 its RoPE and norm.
DOREMI = dict(tie_embeddings=True)
LLAMA3 = dict(rope_theta=500000.0, norm_eps=1e-5, rope_scaling=LLAMA3_ROPE_SCALING)


def shape(*values: int, **family) -> dict:
    """One preset: the SHAPE columns in order, then its family's keys."""
    return {**dict(zip(SHAPE, values, strict=True)), **family}


def hybrid(block_pattern: str, **mamba) -> dict:
    """A hybrid family's keys: its Mamba-2 / attention pattern and the Mamba-2 mixer's shape."""
    return dict(block_pattern=block_pattern, mamba=mamba)


PRESETS: dict[str, dict] = {
    # name: shape(vocab_size, d_model, n_layers, n_heads, n_kv_heads, ffn_dim, max_seq_len, **family)
    "tiny": shape(256, 64, 2, 4, 2, 128, 256),
    "doremi-70m": shape(256000, 256, 3, 4, 4, 1024, 1024, **DOREMI),
    "doremi-150m": shape(256000, 512, 6, 8, 8, 2048, 1024, **DOREMI),
    "doremi-280m": shape(256000, 768, 12, 12, 12, 3072, 1024, **DOREMI),
    "doremi-510m": shape(256000, 1024, 12, 16, 16, 8192, 1024, **DOREMI),
    "doremi-760m": shape(256000, 1280, 12, 20, 20, 8192, 1024, **DOREMI),
    "doremi-1b": shape(256000, 2048, 16, 32, 32, 8192, 1024, **DOREMI),
    # The bench baseline's shapes (experiments/tools/bench/plain_llama.py `1b`, `280m`).
    "bench-1b": shape(32000, 2048, 16, 32, 8, 8192, 2048),
    "bench-280m": shape(32000, 1024, 18, 16, 16, 2816, 1024),
    "moe-tiny": shape(256, 64, 2, 4, 2, 128, 256, moe=dict(num_experts=4, top_k=2, expert_ffn_dim=64)),
    "moe-1b-active": shape(
        32000, 2048, 20, 32, 8, 5632, 2048, moe=dict(num_experts=8, top_k=2, expert_ffn_dim=2048, shared_experts=1)
    ),
    "hybrid-tiny": shape(256, 64, 2, 4, 2, 128, 256, **hybrid("MA", d_state=16, head_dim=16, ngroups=2, chunk_size=8)),
    "hybrid-quickstart": shape(
        2048, 96, 3, 4, 2, 256, 64, **hybrid("MA", d_state=16, head_dim=32, ngroups=2, chunk_size=16)
    ),
    "hybrid-1b": shape(
        32000, 2048, 16, 32, 8, 5632, 2048, **hybrid("MMMA", d_state=128, head_dim=64, ngroups=8, chunk_size=256)
    ),
    "llama3-8b": shape(128256, 4096, 32, 32, 8, 14336, 8192, **LLAMA3),
    "llama3-70b": shape(128256, 8192, 80, 64, 8, 28672, 8192, **LLAMA3),
}
