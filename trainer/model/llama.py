"""The Llama model as pipeline stages, tensor-parallel inside.

Architecture (numerically that of experiments/tools/bench/plain_llama.py): token embedding, blocks of
pre-norm attention (RMSNorm, fused QKV [q | k | v] with grouped-query attention, rotate-half
RoPE with configurable theta and Llama-3 frequency scaling, causal SDPA or flash-attn, output
projection) and pre-norm SwiGLU (fused [gate | up] projection, silu(gate) * up, down
projection), a final RMSNorm and an LM head (optionally tied to the embedding), no biases.

Layout: activations are [s, b, d]; the tensor passed between pipeline stages is [s, b, d], or
[s / tp, b, d] (this rank's sequence shard) under sequence parallel. Per-token losses come out
as [b, s] in fp32.

Parameter names are the single-process ones whatever the layout: `embed.weight`,
`layers.<global index>.{attn_norm,attn.qkv,attn.out,mlp_norm,mlp.gate_up,mlp.down}.weight`,
`norm.weight`, `head.weight`; a MoE block's MLP (`model.moe`, `trainer.model.moe`) is
`mlp.router.weight`, `mlp.experts.{gate_up,down}` and `mlp.shared.{gate_up,down}.weight`. With
tied embeddings the head is `embed.weight` (a copy on the last stage when pp > 1:
`trainer.parallel.tied`). Every parameter's tp, ep and pp placement is a row of
`trainer.model.sharding`, through which the modules are built.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from data.store.batch import IGNORE_INDEX
from trainer.config.mamba import ATTENTION, MAMBA, check_mamba_tp, layer_mixers
from trainer.config.tools import ConfigError
from trainer.model.batch_compile import BatchCompiled
from trainer.model.fp8 import apply_fp8
from trainer.model.init import init_parameters
from trainer.model.layers import (
    causal_attention,
    resolve_attention,
    rope_tables,
)
from trainer.model.mamba.mixer import Mamba2Mixer
from trainer.model.moe import MoE, is_moe_layer
from trainer.model.mup import apply_mup
from trainer.model.ops.kernels import Kernels
from trainer.model.ops.swiglu import swiglu
from trainer.model.sharding import on_stage, tp_module
from trainer.parallel.context import ParallelContext
from trainer.parallel.expert import ExpertParallel
from trainer.parallel.tensor import (
    TensorParallel,
    column_parallel_linear,
    gather_last_dim,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)
from trainer.parallel.tied import head_weight

RECOMPUTE_MODES = ("none", "selective", "full")


def _checkpoint(fn, *args):
    # No dropout anywhere: no RNG state to replay.
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class Attention(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, impl: str, device=None, kernels: Kernels | None = None):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.kernels = kernels or Kernels()
        self.local_heads = cfg.n_heads // tp.size
        self.local_kv_heads = cfg.n_kv_heads // tp.size
        self.impl = impl
        self.recompute_core = False
        # [b, s, d] activations instead of [s, b, d]: DoGE's one pass only (trainer/run/group_grads.py)
        self.batch_first = False
        self.softmax_scale: float | None = None  # muP's 1/d_head (`trainer.model.mup`); None: 1/sqrt(d_head)
        self.qkv = tp_module(
            "attn.qkv", tp, (cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd), cfg.d_model, device=device
        )
        self.out = tp_module("attn.out", tp, (cfg.d_model,), cfg.n_heads * hd, device=device)

    def core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE and causal attention: [s, b, (h + 2 kv) hd / tp] -> [s, b, h hd / tp] ([b, s, .]
        both under `batch_first`: RoPE reads the projection through a transposed view and writes
        q, k, v batch-major, handed to attention as [b, s, ., hd]; attention's output, its
        gradient and the projection's gradient are then batch-major too, none of them copied)."""
        scale = {} if self.softmax_scale is None else {"scale": self.softmax_scale}
        if self.batch_first:
            q, k, v = self.kernels.rope_qkv(
                qkv.transpose(0, 1), cos, sin, self.local_heads, self.local_kv_heads, batch_first=True
            )
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            return causal_attention(q, k, v, self.impl, self.kernels.sdpa_priority, batch_first=True, **scale)
        q, k, v = self.kernels.rope_qkv(qkv, cos, sin, self.local_heads, self.local_kv_heads)
        return causal_attention(q, k, v, self.impl, self.kernels.sdpa_priority, **scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        a = _checkpoint(self.core, qkv, cos, sin) if self.recompute_core else self.core(qkv, cos, sin)
        return self.out(a)


class MLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, device=None):
        super().__init__()
        self.gate_up = tp_module("mlp.gate_up", tp, (cfg.ffn_dim, cfg.ffn_dim), cfg.d_model, device=device)
        self.down = tp_module("mlp.down", tp, (cfg.d_model,), cfg.ffn_dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x)))


def compile_scope(compiled: bool, tp: int, recompute: str) -> str:
    """What `torch.compile` covers (`model.compile` on a GPU): "stage", "blocks" or "none".
    - "stage" at tp = 1 unless full recompute: the whole stage as one graph, so that inductor
      fuses across block boundaries (a block's last residual add into the next block's
      RMSNorm, forward and backward) and sees the head with the blocks (1.063x -> 1.07x the
      baseline at 1B on an H200, experiments/notes/PERFORMANCE.md);
    - "blocks" otherwise: each block's body its own graph, and at tp = 1 the head with the
      cross entropy. At tp > 1 the blocks hold collectives, between which each block is a
      graph; full recompute checkpoints each compiled block eagerly, because inside one graph
      inductor did not recompute all of a checkpointed block (4.9 GiB more than the plan's
      block inputs at 1B)."""
    if not compiled:
        return "none"
    return "stage" if tp == 1 and recompute != "full" else "blocks"


class Block(nn.Module):
    """Pre-norm attention + SwiGLU. `recompute` (per block): `none`; `selective` recomputes the
    attention core (RoPE + attention) in backward; `full` keeps only the block input.
    `mixer` "mamba": a Mamba-2 mixer (`trainer.model.mamba.mixer`) in place of attention (`mamba_norm`,
    `mamba`); selective recompute then recomputes its convolution, scan and gated norm."""

    def __init__(
        self,
        cfg,
        tp: TensorParallel,
        impl: str,
        recompute: str = "none",
        compile: bool = False,
        device=None,
        kernels: Kernels | None = None,
        mixer: str = ATTENTION,
        layer: int = 0,
        ep: ExpertParallel | None = None,
    ):
        super().__init__()
        self.mixer = mixer
        if mixer == MAMBA:
            self.mamba_norm = tp_module("mamba_norm", tp, (cfg.d_model,), eps=cfg.norm_eps, device=device)
            self.mamba = Mamba2Mixer(cfg, tp, device=device)
        else:
            self.attn_norm = tp_module("attn_norm", tp, (cfg.d_model,), eps=cfg.norm_eps, device=device)
            self.attn = Attention(cfg, tp, impl, device=device, kernels=kernels)
        self.mlp_norm = tp_module("mlp_norm", tp, (cfg.d_model,), eps=cfg.norm_eps, device=device)
        self.mlp = MoE(cfg, tp, ep, device=device) if is_moe_layer(cfg, layer) else MLP(cfg, tp, device=device)
        self.recompute = recompute
        self.compile_body(compile)

    def compile_body(self, enabled: bool) -> None:
        """Run `body` compiled (its own graph) or eagerly (alone, or inside a compiled stage)."""
        self._compiled = BatchCompiled(self.body, (1, None, None)) if enabled else None

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"parallelism.recompute: expected one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
        self._recompute = mode
        (self.mamba if self.mixer == MAMBA else self.attn).recompute_core = mode == "selective"

    def pre_norm(self, norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, its norm): a seam that DoGE's one pass (`trainer.run.group_grads`)
        replaces on the instance by one autograd function whose backward receives both outputs'
        gradients, the fused add-norm backward (`trainer.model.ops.group_norm_backward`)."""
        return x, norm(x)

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.mixer == MAMBA:
            x, h = self.pre_norm(self.mamba_norm, x)
            x = x + self.mamba(h)
        else:
            x, h = self.pre_norm(self.attn_norm, x)
            x = x + self.attn(h, cos, sin)
        x, h = self.pre_norm(self.mlp_norm, x)
        return x + self.mlp(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        body = self._compiled or self.body
        return _checkpoint(body, x, cos, sin) if self._recompute == "full" else body(x, cos, sin)


class LlamaStage(nn.Module):
    """The blocks `layers` (global indices) of one pipeline stage, with the embedding on the
    first stage and the final norm, head and loss on the last. See the module docstring."""

    def __init__(
        self,
        cfg,
        tp: TensorParallel,
        layers: range,
        is_first: bool,
        is_last: bool,
        recompute: str = "none",
        device: torch.device | str | None = None,
        kernels: Kernels | None = None,
        ep: ExpertParallel | None = None,
    ):
        super().__init__()
        device = torch.device(device or "cpu")
        self.cfg = cfg
        self.kernels = kernels or Kernels()
        self.tp = tp
        self.is_first, self.is_last = is_first, is_last
        self.tie_embeddings = cfg.tie_embeddings
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, tp.size)
        impl = resolve_attention(cfg.attention, device)
        self._compiled = bool(cfg.compile) and device.type == "cuda"
        # tp = 1 and compiled: the head's matmul and a plain cross entropy in one graph.
        self._fused_loss = self._compiled and tp.size == 1
        if on_stage("embed.weight", cfg.tie_embeddings, is_first, is_last):
            self.embed = tp_module("embed", tp, (self.padded_vocab,), cfg.d_model, device=device)
        mixers = layer_mixers(getattr(cfg, "block_pattern", ""), cfg.n_layers)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    cfg, tp, impl, recompute, device=device, kernels=self.kernels, mixer=mixers[i], layer=i, ep=ep
                )
                for i in layers
            }
        )
        if is_last:
            self.norm = tp_module("norm", tp, (cfg.d_model,), eps=cfg.norm_eps, device=device)
            if on_stage("head.weight", cfg.tie_embeddings, is_first, is_last):
                self.head = tp_module("head", tp, (self.padded_vocab,), cfg.d_model, device=device)
        self.set_recompute(recompute)
        self.logit_scale = 1.0  # muP's readout multiplier (`trainer.model.mup`)
        # [b, s, d] activations instead of [s, b, d] (with every `Attention.batch_first`): set by
        # trainer/run/group_grads.py for DoGE's one pass, whose per-group weight gradients then
        # read each group's rows as one contiguous [rows x s, d] block
        self.batch_first = False
        self.head_fp8 = None  # the head's FP8 GEMMs (`model.fp8.layers: [..., head]`, `apply_fp8`)
        apply_mup(self, cfg)
        apply_fp8(self, getattr(cfg, "fp8", None), device)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_recompute(self, mode: str) -> None:
        """Every block's recompute mode, and what is compiled for it (`compile_scope`)."""
        for block in self.layers.values():
            block.recompute = mode
        scope = compile_scope(self._compiled, self.tp.size, mode)
        self._whole_graph = scope == "stage"
        for block in self.layers.values():
            block.compile_body(scope == "blocks")
        fused_head = self._fused_loss and not self._whole_graph
        self._losses = BatchCompiled(self.head_losses, (1, 0)) if fused_head else self.head_losses
        self._run_compiled = BatchCompiled(self._run, (1, 0, 0)) if self._whole_graph else self._run

    # -- the inter-stage tensor ------------------------------------------------------------
    def activation_shape(self, batch_size: int, seq_len: int) -> tuple[int, ...]:
        tp = self.tp
        if tp.sequence_parallel and seq_len % tp.size:
            raise ValueError(f"sequence parallel: sequence length {seq_len} is not divisible by tp={tp.size}")
        return (seq_len // tp.size if tp.sequence_parallel else seq_len, batch_size, self.cfg.d_model)

    @property
    def activation_dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.parameters()), torch.get_default_dtype())

    # -- forward ---------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = x.shape[1 if self.batch_first else 0] * (self.tp.size if self.tp.sequence_parallel else 1)
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.rope_cos.shape[0]}")
        return self.rope_cos[:seq], self.rope_sin[:seq]

    def hidden(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """This stage's blocks applied to its input: [s(/tp), b, d]."""
        return self._blocks(hidden, batch["input_ids"] if self.is_first else None)

    def _blocks(self, hidden: torch.Tensor | None, input_ids: torch.Tensor | None) -> torch.Tensor:
        if self.is_first:
            x = self.embed(input_ids)
        elif hidden is None:
            raise ValueError("LlamaStage.forward: a stage after the first needs the previous stage's hidden states")
        else:
            x = hidden
        cos, sin = self._rope(x)
        for block in self.layers.values():
            x = block(x, cos, sin)
        return x

    def _run(
        self, hidden: torch.Tensor | None, input_ids: torch.Tensor | None, labels: torch.Tensor | None
    ) -> torch.Tensor:
        x = self._blocks(hidden, input_ids)
        return self._losses(x, labels) if self.is_last else x

    def _local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, padded_vocab / tp]: this rank's vocabulary slice over the full sequence."""
        h = self.norm(x)
        h = h if self.logit_scale == 1.0 else h * self.logit_scale
        return column_parallel_linear(h, head_weight(self), self.tp, self.head_fp8)

    def head_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Final norm, head and per-token cross entropy: [s(/tp), b, d] ([b, s, d] under
        `batch_first`), [b, s] -> [b, s] fp32."""
        logits = self._local_logits(x)
        target = labels if self.batch_first else labels.t()
        if self._fused_loss:
            losses = self.kernels.cross_entropy(logits, target, self.cfg.vocab_size, IGNORE_INDEX)
        else:
            losses = vocab_parallel_cross_entropy(logits, target, self.tp, self.cfg.vocab_size, IGNORE_INDEX)
        return losses.contiguous() if self.batch_first else losses.t().contiguous()

    def forward(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """Hidden states for the next stage, or on the last stage per-token losses [b, s] (fp32,
        0 where labels == -100), identical on every tp rank."""
        return self._run_compiled(
            hidden, batch["input_ids"] if self.is_first else None, batch["labels"] if self.is_last else None
        )

    def logits(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """Last stage: logits [b, s, vocab_size], gathered over tp (for eval and tests)."""
        if not self.is_last:
            raise ValueError("LlamaStage.logits: only the last pipeline stage has the head")
        local = gather_last_dim(self._local_logits(self.hidden(hidden, batch)), self.tp)[..., : self.cfg.vocab_size]
        return local if self.batch_first else local.transpose(0, 1)


def _check_layout(cfg, tp: int, layers: range) -> None:
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % tp:
            raise ConfigError(f"parallelism.tp: expected a divisor of model.{name}={getattr(cfg, name)}, got {tp}")
    check_mamba_tp(cfg, tp)
    if layers.step != 1 or layers.start < 0 or layers.stop > cfg.n_layers or layers.start > layers.stop:
        raise ConfigError(
            f"build_stage: layers {layers} are not a contiguous range within model.n_layers={cfg.n_layers}"
        )


def build_stage(cfg, par, pc: ParallelContext, layers: range, seed: int = 0) -> LlamaStage:
    """This rank's pipeline stage (blocks `layers`), tp-sharded, initialised on pc.device as the
    tp slice of the single-process model with the same seed."""
    _check_layout(cfg, pc.tp, layers)
    if getattr(par, "ep", 1) != pc.ep:
        raise ConfigError(f"parallelism.ep={par.ep}, but the process grid was made with ep={pc.ep}")
    tp = TensorParallel.from_config(par, pc)
    ep = ExpertParallel.from_context(pc)
    stage = LlamaStage(cfg, tp, layers, pc.is_first_stage, pc.is_last_stage, par.recompute, pc.device, ep=ep)
    init_parameters(stage, cfg, seed, tp.rank, tp.size)
    return stage


class Llama(LlamaStage):
    """The whole model as one stage (pp = 1): `Llama(cfg)(None, batch)` gives per-token losses.
    `kernels`: the implementations of RoPE, the fused loss and the SDPA backend order (default:
    the model's own; the GPU bench's ablations pass others)."""

    def __init__(self, cfg, par=None, pc: ParallelContext | None = None, seed: int = 0, kernels: Kernels | None = None):
        from trainer.config.schema import ParallelismConfig

        pc = pc or ParallelContext.single()
        par = par or ParallelismConfig(tp=pc.tp)
        if pc.pp != 1:
            raise ConfigError(f"Llama: the whole model needs parallelism.pp=1, got {pc.pp}; use build_stage")
        _check_layout(cfg, pc.tp, range(cfg.n_layers))
        tp = TensorParallel.from_config(par, pc)
        super().__init__(cfg, tp, range(cfg.n_layers), True, True, par.recompute, pc.device, kernels)
        init_parameters(self, cfg, seed, tp.rank, tp.size)
