"""`StackedLlama`: M Llama models of one shape as one module, every weight [M, ...].

The math is `trainer.model.llama.Llama`'s at tp = pp = 1, op for op: embedding, pre-norm blocks
(RMSNorm, fused QKV, RoPE through the model's `Kernels.rope_qkv`, causal SDPA through
`trainer.model.layers.causal_attention`, output projection; RMSNorm, fused [gate | up], the
fused SwiGLU, down projection), final RMSNorm, head, and the per-token cross entropy of
`Kernels.cross_entropy`. Only the batching over models is new: projections are `torch.bmm`
over [M, b s, in] (`trainer.stacked.layers`), and RoPE and attention see the M models as M
times the batch ([s, M b, ...], a transposed view of the [M, b, s, ...] activations): attention
never mixes sequences, so model m's queries meet only model m's keys.

Parameters carry `Llama`'s names, so model m is `{name: p[m]}` (`unstack`), and a stacked model
is built from M ordinary `Llama`s initialised with their seeds (`stack_llamas`): the
initialisation is the ordinary trainer's by construction, not re-derived.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from data.store.batch import IGNORE_INDEX
from trainer.config.schema import ModelConfig
from trainer.model.layers import causal_attention, resolve_attention, rope_tables
from trainer.model.llama import RECOMPUTE_MODES, Llama
from trainer.model.ops.kernels import Kernels
from trainer.model.ops.swiglu import swiglu
from trainer.parallel.context import ParallelContext
from trainer.parallel.tensor import padded_vocab_size
from trainer.stacked.head import stacked_head_objective
from trainer.stacked.layers import StackedEmbedding, StackedLinear, StackedRMSNorm


def _checkpoint(fn, *args):
    # No dropout: no RNG state to replay (as trainer.model.llama).
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def to_heads(x: torch.Tensor) -> torch.Tensor:
    """[M, b, s, w] -> [s, M b, w]: the models as more sequences of one batch, a view (RoPE
    reads rows of any strides, `trainer.model.ops.rope`)."""
    return x.flatten(0, 1).transpose(0, 1)


def from_heads(x: torch.Tensor, models: int) -> torch.Tensor:
    """[s, M b, w] -> [M, b, s, w], a view (the gradient of attention's output, [M, b s, w]
    from the output projection's backward, reaches SDPA's backward without a copy; the output
    itself is [s, M b]-major as RoPE's q is, and the projection copies it: design 4d-iii)."""
    return x.transpose(0, 1).unflatten(0, (models, -1))


class StackedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, models: int, impl: str, kernels: Kernels, device: torch.device):
        super().__init__()
        hd = cfg.head_dim
        self.heads, self.kv_heads, self.impl, self.kernels = cfg.n_heads, cfg.n_kv_heads, impl, kernels
        self.recompute_core = False
        self.qkv = StackedLinear(models, cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, device)
        self.out = StackedLinear(models, cfg.n_heads * hd, cfg.d_model, device)

    def core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE and causal attention: [M, b, s, (h + 2 kv) hd] -> [M, b, s, h hd]."""
        q, k, v = self.kernels.rope_qkv(to_heads(qkv), cos, sin, self.heads, self.kv_heads)
        return from_heads(causal_attention(q, k, v, self.impl, self.kernels.sdpa_priority), qkv.shape[0])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        a = _checkpoint(self.core, qkv, cos, sin) if self.recompute_core else self.core(qkv, cos, sin)
        return self.out(a)


class StackedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, models: int, device: torch.device):
        super().__init__()
        self.gate_up = StackedLinear(models, cfg.d_model, 2 * cfg.ffn_dim, device)
        self.down = StackedLinear(models, cfg.ffn_dim, cfg.d_model, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x)))


class StackedBlock(nn.Module):
    """`trainer.model.llama.Block` over M models; `recompute` as there (none, selective, full)."""

    def __init__(
        self, cfg: ModelConfig, models: int, impl: str, kernels: Kernels, device: torch.device, recompute: str
    ):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"parallelism.recompute: expected one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        self.attn_norm = StackedRMSNorm(models, cfg.d_model, cfg.norm_eps, device)
        self.attn = StackedAttention(cfg, models, impl, kernels, device)
        self.mlp_norm = StackedRMSNorm(models, cfg.d_model, cfg.norm_eps, device)
        self.mlp = StackedMLP(cfg, models, device)
        self.full_recompute = recompute == "full"
        self.attn.recompute_core = recompute == "selective"

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _checkpoint(self.body, x, cos, sin) if self.full_recompute else self.body(x, cos, sin)


class StackedLlama(nn.Module):
    """M Llama models of config `cfg` (see the module docstring). Parameters are uninitialised:
    build through `stack_llamas`. `forward(batch)` with `input_ids`, `labels` [M, b, s] gives
    per-token losses [M, b, s] (fp32, 0 where labels == -100)."""

    def __init__(
        self,
        cfg: ModelConfig,
        models: int,
        device: torch.device | str = "cpu",
        recompute: str = "none",
        kernels: Kernels | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.cfg, self.models = cfg, models
        self.kernels = kernels or Kernels()
        #: The training head through `trainer.stacked.head` (False: the unfused head, which
        #: keeps the logits for backward; the same numbers, for stacked_bench's comparison).
        self.fused_head = True
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, 1)
        impl = resolve_attention(cfg.attention, device)
        self.embed = StackedEmbedding(models, self.padded_vocab, cfg.d_model, device)
        self.layers = nn.ModuleDict(
            {str(i): StackedBlock(cfg, models, impl, self.kernels, device, recompute) for i in range(cfg.n_layers)}
        )
        self.norm = StackedRMSNorm(models, cfg.d_model, cfg.norm_eps, device)
        if not cfg.tie_embeddings:
            self.head = StackedLinear(models, cfg.d_model, self.padded_vocab, device)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # As `Llama` at tp = 1 with model.compile on a GPU: the whole forward as one graph.
        compiled = bool(cfg.compile) and device.type == "cuda" and recompute != "full"
        self._run_compiled = torch.compile(self._run, dynamic=False) if compiled else self._run

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.cfg.tie_embeddings else self.head.weight

    def _run(
        self, input_ids: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        seq = x.shape[2]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for block in self.layers.values():
            x = block(x, cos, sin)
        m, b, s, d = x.shape
        h = self.norm(x).reshape(m, b * s, d)
        if weights is not None and self.fused_head:
            # The dtype autocast gives the head's bmm in the unfused path below.
            device = h.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
            objective, losses = stacked_head_objective(
                h.to(dtype),
                self.head_weight().to(dtype),
                labels.reshape(m, b * s),
                weights.reshape(m, b * s),
                self.cfg.vocab_size,
                IGNORE_INDEX,
            )
            return objective, losses.view(m, b, s)
        logits = torch.bmm(h, self.head_weight().transpose(1, 2))
        losses = self.kernels.cross_entropy(logits, labels.reshape(m, b * s), self.cfg.vocab_size, IGNORE_INDEX)
        losses = losses.view(m, b, s)
        return losses if weights is None else ((weights * losses).sum(), losses.detach())

    def forward(
        self, batch: dict, weights: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token losses [M, b, s] (fp32) of model m on `input_ids[m]`, `labels[m]`. Given
        `weights` [M, b, s] (each token's weight in the training objective): (the objective
        sum(weights * losses), to call backward on, and the losses, detached), the head's
        logits and their gradient made in the forward (`trainer.stacked.head`;
        its loss is `trainer.model.ops.cross_entropy`'s, whatever `kernels.cross_entropy` is)
        unless `fused_head` is off."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        if input_ids.shape[0] != self.models or labels.shape != input_ids.shape:
            raise ValueError(
                f"StackedLlama: expected input_ids and labels [{self.models}, b, s], "
                f"got {tuple(input_ids.shape)} and {tuple(labels.shape)}"
            )
        return self._run_compiled(input_ids, labels, weights)

    # -- one model in, one model out ---------------------------------------------------------
    @torch.no_grad()
    def load_model(self, m: int, state: dict[str, torch.Tensor]) -> None:
        """Set model m's slice of every parameter from an ordinary `Llama` state dict."""
        for name, p in self.named_parameters():
            p[m].copy_(state[name])

    def unstack(self, m: int) -> dict[str, torch.Tensor]:
        """Model m as an ordinary `Llama` state dict (detached copies, on the stacked device)."""
        return {name: p[m].detach().clone() for name, p in self.named_parameters()}

    def llama(self, m: int) -> Llama:
        """Model m as an ordinary `Llama` (on the stacked device), e.g. to evaluate or save it."""
        device = self.rope_cos.device
        model = Llama(self.cfg, pc=ParallelContext.single(device), kernels=self.kernels)
        model.load_state_dict(self.unstack(m))
        return model.to(device)


def stack_llamas(
    cfg: ModelConfig,
    seeds: Sequence[int],
    device: torch.device | str = "cpu",
    recompute: str = "none",
    kernels: Kernels | None = None,
) -> StackedLlama:
    """M = len(seeds) models, model m initialised exactly as `Llama(cfg, seed=seeds[m])` on
    `device` (the ordinary trainer's `build_model` with train.seed = seeds[m]: the init draws on
    the device's generator, so CPU and CUDA inits differ, as they do there). The ordinary
    models are built one at a time, so their memory is one model's."""
    device = torch.device(device)
    stacked = StackedLlama(cfg, len(seeds), device, recompute, kernels)
    names = {n for n, _ in stacked.named_parameters()}
    for m, seed in enumerate(seeds):
        one = Llama(cfg, pc=ParallelContext.single(device), seed=seed)
        state = dict(one.named_parameters())
        if set(state) != names:
            raise RuntimeError(f"stack_llamas: Llama's parameters {sorted(state)} are not the stacked {sorted(names)}")
        stacked.load_model(m, state)
        del one
    return stacked
