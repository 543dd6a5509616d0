"""`Kernels`: which implementation the model calls for each op that has more than one.

Why an explicit argument: the GPU bench times the step with one optimisation undone (an earlier
RoPE, cross entropy left to inductor, another attention backend first). Chosen by replacing a
module attribute under the name the model happens to import it by, a renamed import would turn
such an ablation silently into the plain step. The model instead calls each op through the
`Kernels` it was built with (`trainer.model.llama.Llama(..., kernels=...)`), and a field that
does not exist is an error. The defaults are what the model runs otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from trainer.model.layers import CUDA_SDPA_PRIORITY
from trainer.model.ops.cross_entropy import cross_entropy
from trainer.model.ops.rope import rope_qkv

#: (qkv [s, b, (h + 2 kv) hd], cos, sin, heads, kv_heads, batch_first=False) -> q, k, v [s, b, heads, hd]
#: (batch-major in memory under `batch_first`: `trainer.model.ops.rope.rope_qkv`)
RopeQKV = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
#: (logits [..., V], target [...], vocab_size, ignore_index) -> per-token loss [...] fp32
CrossEntropy = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    #: RoPE on the fused QKV projection (`trainer.model.ops.rope`).
    rope_qkv: RopeQKV = rope_qkv
    #: The per-token loss of the compiled head at tp = 1 (`trainer.model.ops.cross_entropy`); the
    #: eager and tp > 1 heads use the vocabulary-parallel loss whatever this is.
    cross_entropy: CrossEntropy = cross_entropy
    #: SDPA backends on CUDA in the order tried (`trainer.model.layers.causal_attention`).
    sdpa_priority: tuple[SDPBackend, ...] = CUDA_SDPA_PRIORITY
