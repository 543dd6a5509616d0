"""The pure cost model of one pipeline stage: compute and memory per rank (the stage split's
and `doremi plan`'s).

Per rank (one tp shard of one stage), per micro-batch of T = b x s tokens; h = d_model,
f = ffn_dim, a = heads, g = kv heads, d = h / a, V = vocabulary (padded to a multiple of tp),
t = tp. Activations are bf16 (autocast), 2 bytes.

Compute (matmul FLOPs; norms, RoPE, softmax ignored): a block's forward is
2 T P_block / t + 2 T s h / t, P_block = h(h + 2gd) + h^2 + 3hf its matmul parameters and
2 T s h / t the causal half of QK^T and AV (flash skips masked blocks). Training costs
forward + backward (2x) + recompute (selective: the attention core's forward again; full: the
whole forward again). The head costs 3 x 2 T h V / t; the embedding lookup is free.

Memory: see `layer_activation_bytes` for the per-block formula (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Sec. 4, adapted to
RMSNorm/SwiGLU/GQA and to our model) and `StageMemory` for what each stage holds. Under 1F1B,
stage p holds min(pp - p, M) micro-batches in flight; under afab all M. The first stage holds
the embedding, the last the final norm, the head and the loss.

Hybrid stacks (`model.block_pattern`): a stage's blocks are counted by kind (attention or
Mamba-2; `trainer.config.mamba.layer_mixers`), from the stage's first layer when the
caller gives it (`first`: the split and the plan do) and otherwise in the pattern's proportions.
A Mamba-2 block's compute adds the chunked scan and its memory the scan's saved tensors,
including the per-chunk states H P N (`mamba_activation_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config.mamba import ATTENTION, MAMBA, layer_mixers, mamba_mixer_params, ssd_flops_per_token
from trainer.config.schema import ModelConfig, ParallelismConfig
from trainer.parallel.data_parallel import sums_gradients
from trainer.parallel.tied import holds_embedding, holds_head

ACT_BYTES = 2
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class BytesPerParam:
    """Persistent bytes per parameter.

    fp32 (our GPU path): fp32 parameters under bf16 autocast: 4 weight + 4 grad + 8 AdamW
    (m, v) sharded over dp by ZeRO-1, plus a 2-byte bf16 copy made by autocast's weight cache
    and kept for backward (one copy per step when the schedule runs inside one autocast
    region). bf16 (Megatron's distributed optimizer, Korthikanti et al. / Rajbhandari et al.):
    2 bf16 weight + 4 fp32 main grad + 10 (the fp32 master's 2-byte low half,
    `trainer.optim.adamw_update.split_fp32`; fp32 m and v) sharded over dp. When nothing
    sums gradients (`trainer.parallel.data_parallel.sums_gradients`) there is no main grad: the update
    reads autograd's bf16 `.grad`, which exists only from its backward to the step, so at the
    peak (backward's start) only the head's is alive: `CostModel.stage_memory` counts it in the
    transient and the persistent grad bytes are 0."""

    weight: float
    grad: float
    optimizer: float
    cast: float

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optimizer + self.cast


OPTIMIZERS = ("adamw", "adafactor")


def bytes_per_param(
    param_precision: str, dp: int, zero1: bool, summed_grads: bool = True, optimizer: str = "adamw"
) -> BytesPerParam:
    """`summed_grads`: gradients are summed over micro-batches or ranks (bf16: fp32 main grads).
    `optimizer` "adafactor" (fp32 parameters only, as `trainer.optim.build` builds it) keeps no
    per-parameter state: its factored second moment depends on the tensors' shapes, so
    `optimizer` is 0 here and `CostModel.optimizer_state_bytes` counts it."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    shards = dp if zero1 else 1
    if param_precision == "fp32":
        return BytesPerParam(4.0, 4.0, 8.0 / shards if optimizer == "adamw" else 0.0, 2.0)
    if optimizer != "adamw":
        raise ValueError("bf16 parameters keep fp32 master weights in AdamW only, got optimizer 'adafactor'")
    if param_precision == "bf16":
        return BytesPerParam(2.0, 4.0 if summed_grads else 0.0, 10.0 / shards, 0.0)
    raise ValueError(f"param_precision: expected one of {', '.join(PRECISIONS)}, got {param_precision!r}")


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of one stage. `activations` = in_flight x per-micro-batch activations;
    `transient` is the largest short-lived allocation on top (logits, a recomputed block)."""

    params: int
    weights: float
    grads: float
    optimizer: float
    cast: float
    activations_per_micro_batch: float
    in_flight: int
    transient: float

    @property
    def activations(self) -> float:
        return self.in_flight * self.activations_per_micro_batch

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.cast + self.activations + self.transient


@dataclass(frozen=True)
class CostModel:
    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    seq_len: int = 256
    micro_batches: int = 1  # per dp rank per step
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    recompute_allgather: bool = False
    zero1: bool = True
    param_precision: str = "fp32"
    optimizer: str = "adamw"
    #: `model.compile` on a GPU: inductor's graphs decide what a block saves (see
    #: `layer_activation_bytes`); at tp = 1 the head and the loss are one graph.
    compiled: bool = False

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        par: ParallelismConfig,
        micro_batch_size: int,
        seq_len: int,
        micro_batches: int | None = None,
        param_precision: str = "fp32",
        optimizer: str = "adamw",
    ) -> CostModel:
        return cls(
            model=model,
            tp=par.tp,
            pp=par.pp,
            dp=par.dp,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            micro_batches=micro_batches or par.pp,
            schedule=par.pp_schedule,
            recompute=par.recompute,
            sequence_parallel=par.sequence_parallel and par.tp > 1,
            recompute_allgather=par.tp_recompute_allgather,
            zero1=par.zero1,
            param_precision=param_precision,
            optimizer=optimizer,
            compiled=bool(model.compile),
        )

    @property
    def fused_loss(self) -> bool:
        """The compiled head + cross entropy (`LlamaStage._fused_loss`): tp = 1 and compiled."""
        return self.compiled and self.tp == 1

    # --- shapes ---------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def local_vocab(self) -> int:
        return math.ceil(self.model.vocab_size / self.tp)

    @property
    def _sp(self) -> int:
        """Divisor of the sequence-parallel regions (norm inputs, stage boundary)."""
        return self.tp if self.sequence_parallel else 1

    @property
    def _gathered(self) -> int:
        """Divisor of the column-linear inputs saved for backward: only the local sequence
        shard when the all-gather is recomputed in backward, else the gathered sequence."""
        return self.tp if self.sequence_parallel and self.recompute_allgather else 1

    # --- parameters (per rank) ------------------------------------------------------------

    def block_matmul_params(self) -> int:
        m = self.model
        kv = m.n_kv_heads * m.head_dim
        return m.d_model * (m.d_model + 2 * kv) + m.d_model * m.d_model + 3 * m.d_model * m.ffn_dim

    def block_params(self) -> int:
        return self.block_matmul_params() // self.tp + 2 * self.model.d_model

    def mamba_block_params(self) -> int:
        """A Mamba-2 block on one rank: the mixer split over tp (every part is), the MLP's
        matmuls over tp, two norms."""
        m = self.model
        return (mamba_mixer_params(m) + 3 * m.d_model * m.ffn_dim) // self.tp + 2 * m.d_model

    def block_kinds(self, n_blocks: int, first: int | None = None) -> dict[str, float]:
        """How many of a stage's `n_blocks` blocks are attention and Mamba-2: those of layers
        first..first+n_blocks-1, or with `first` None the pattern's proportions."""
        mixers = layer_mixers(getattr(self.model, "block_pattern", ""), self.model.n_layers)
        if MAMBA not in mixers:
            return {ATTENTION: n_blocks}
        if first is not None:
            own = mixers[first : first + n_blocks]
            return {ATTENTION: own.count(ATTENTION), MAMBA: own.count(MAMBA)}
        share = mixers.count(MAMBA) / len(mixers)
        return {ATTENTION: n_blocks * (1 - share), MAMBA: n_blocks * share}

    def _blocks_params(self, n_blocks: int, first: int | None) -> int:
        kinds = self.block_kinds(n_blocks, first)
        return round(kinds[ATTENTION] * self.block_params() + kinds.get(MAMBA, 0) * self.mamba_block_params())

    def vocab_matrix_params(self) -> int:
        """The embedding's or the head's (vocabulary x d_model, this rank's vocabulary slice)."""
        return self.local_vocab * self.model.d_model

    def stage_params(self, stage: int, n_blocks: int, first: int | None = None) -> int:
        """Blocks, the embedding where the stage holds it (the last stage too when tied and pp > 1:
        `trainer.parallel.tied`), the head where untied, and the final norm on the last stage."""
        first_layer, first, last = first, stage == 0, stage == self.pp - 1
        tie = self.model.tie_embeddings
        return (
            self._blocks_params(n_blocks, first_layer)
            + (self.vocab_matrix_params() if holds_embedding(tie, first, last) else 0)
            + (self.vocab_matrix_params() if holds_head(tie, last) else 0)
            + (self.model.d_model if last else 0)
        )

    def stage_tensor_shapes(self, stage: int, n_blocks: int, first: int | None = None) -> list[tuple[int, ...]]:
        """This rank's parameter shapes on the stage (`trainer.model.sharding`: fused qkv and
        gate|up column-parallel, out and down row-parallel, norms replicated)."""
        m, t = self.model, self.tp
        h, kv = m.d_model, m.n_kv_heads * m.head_dim
        block = [(h,), ((h + 2 * kv) // t, h), (h, h // t), (h,), (2 * m.ffn_dim // t, h), (h, m.ffn_dim // t)]
        blocks = block * n_blocks
        kinds = self.block_kinds(n_blocks, first if first is not None else 0)
        if kinds.get(MAMBA):
            mc = m.mamba
            di, heads, bc = mc.d_inner(h) // t, mc.n_heads(h) // t, mc.ngroups * mc.d_state // t
            mixer = [(h,), (2 * di + 2 * bc + heads, h), (di + 2 * bc, mc.d_conv), (di + 2 * bc,)]
            mixer += [(heads,)] * 3 + [(di,), (h, di)]
            blocks = block * int(kinds[ATTENTION]) + (mixer + block[3:]) * int(kinds[MAMBA])
        first, last = stage == 0, stage == self.pp - 1
        tie = m.tie_embeddings
        vocab = [(self.local_vocab, h)]
        return (
            blocks
            + (vocab if holds_embedding(tie, first, last) else [])
            + (vocab if holds_head(tie, last) else [])
            + ([(h,)] if last else [])
        )

    def optimizer_state_bytes(self, stage: int, n_blocks: int, first: int | None = None) -> float:
        """Optimizer state on one rank, sharded over dp by ZeRO-1. AdamW: fp32 m and v (and the
        bf16 path's master remainder), `bytes_per_param`. Adafactor (`torch.optim.Adafactor`,
        checked by tests/test_plan_search.py against what it allocates): no first moment; an
        r x c matrix keeps an fp32 row and column second moment, 4 (r + c) bytes, a vector its
        full fp32 second moment."""
        shards = self.dp if self.zero1 else 1
        if self.optimizer == "adamw":
            per = bytes_per_param(self.param_precision, self.dp, self.zero1)
            return self.stage_params(stage, n_blocks, first) * per.optimizer
        total = sum(
            4.0 * (s[0] + s[1]) if len(s) == 2 else 4.0 * s[0] for s in self.stage_tensor_shapes(stage, n_blocks, first)
        )
        return total / shards

    # --- compute ----------------------------------------------------------------------------

    def block_flops(self) -> float:
        """Training FLOPs of one block for one micro-batch on one rank."""
        m, t = self.model, self.tokens
        matmul = 2 * t * self.block_matmul_params() / self.tp
        attention = 2 * t * self.seq_len * m.d_model / self.tp
        extra = {"none": 0.0, "selective": attention, "full": matmul + attention}[self.recompute]
        return 3 * (matmul + attention) + extra

    def mamba_block_flops(self) -> float:
        """Training FLOPs of one Mamba-2 block for one micro-batch on one rank: the in/out
        projections and the MLP as matmuls, the chunked scan (`ssd_flops_per_token`); selective
        recompute redoes the scan, full the whole forward."""
        m, t = self.model, self.tokens
        mc = m.mamba
        di, bc, heads = mc.d_inner(m.d_model), mc.ngroups * mc.d_state, mc.n_heads(m.d_model)
        proj = m.d_model * (2 * di + 2 * bc + heads) + di * m.d_model + 3 * m.d_model * m.ffn_dim
        matmul = 2 * t * proj / self.tp
        scan = t * ssd_flops_per_token(m) / 3 / self.tp
        extra = {"none": 0.0, "selective": scan, "full": matmul + scan}[self.recompute]
        return 3 * (matmul + scan) + extra

    def head_flops(self) -> float:
        return 3 * 2 * self.tokens * self.model.d_model * self.local_vocab

    def stage_flops(self, stage: int, n_blocks: int, first: int | None = None) -> float:
        kinds = self.block_kinds(n_blocks, first)
        mamba = kinds[MAMBA] * self.mamba_block_flops() if MAMBA in kinds else 0.0
        blocks = kinds[ATTENTION] * self.block_flops() + mamba
        return blocks + (self.head_flops() if stage == self.pp - 1 else 0.0)

    # --- memory -----------------------------------------------------------------------------

    def layer_activation_bytes(self, recompute: str | None = None) -> float:
        """Bytes one block saves for backward, per micro-batch, on one rank.

        Per token, with B = 2 (bf16), t = tp, t_sp = t with sequence parallel (else 1), t_ag =
        t when the all-gathered inputs are recomputed in backward (else 1):
          none:      2 (B h + 4) / t_sp        two RMSNorm inputs + fp32 rstd
                   + 2 B h / t_ag              QKV and gate/up linear inputs
                   + B (h + 2 g d) / t         q, k, v (after RoPE) kept by attention
                   + B h / t + 4 a / t         attention output (out-proj input), fp32 logsumexp
                   + 2 B f / t + B f / t       fused SwiGLU input (gate|up), down-proj input
          selective: none - 4 a / t            attention core recomputed from q, k, v: with
                                               flash attention there is no s^2 term to save
          full:      B h / t_sp                the block input only
        Korthikanti's GPT count is 34 s b h (+5 a s^2 b without flash); ours is about
        12 h + 4 g d + 6 f per token at t = 1, i.e. 33.5 h for Llama-3-70B.

        Compiled blocks at t = 1 (`compiled`): inductor's partitioner picks what to keep, read
        from the allocator on an H200 (experiments/notes/PERFORMANCE.md, `profile_step.py`):
          none:      B (6 h + 2 g d + 3 f) + 4 a + 8   the eager set less one normalised input
                                                     (recomputed from its block input), plus the
                                                     attention output in SDPA's layout besides
                                                     the out-proj input
          selective: B (5 h + 2 g d + 3 f) + 8       qkv and the core's output; q, k and the
                                                     SDPA output are rebuilt in backward
          full:      B h                             as eager
        """
        recompute = recompute or self.recompute
        m, t, b = self.model, self.tp, ACT_BYTES
        h, f, heads = m.d_model, m.ffn_dim, m.n_heads
        kv = m.n_kv_heads * m.head_dim
        if recompute == "full":
            per_token = b * h / self._sp
        elif self.compiled and t == 1:
            per_token = (
                b * (6 * h + 2 * kv + 3 * f) + 4 * heads + 8
                if recompute == "none"
                else b * (5 * h + 2 * kv + 3 * f) + 8
            )
        else:
            per_token = (
                2 * (b * h + 4) / self._sp
                + 2 * b * h / self._gathered
                + b * (h + 2 * kv) / t
                + b * h / t
                + 3 * b * f / t
            )
            if recompute == "none":
                per_token += 4 * heads / t
        return per_token * self.tokens

    def mamba_activation_bytes(self, recompute: str | None = None) -> float:
        """Bytes one Mamba-2 block saves for backward, per micro-batch, on one rank (eager; B = 2,
        fp32 = 4; d_i = expand h, c = d_i + 2 G N, H heads, chunk Q), per token:
          none:      2 (B h + 4) / t_sp + 2 B h / t_ag      the two norms' and linears' inputs
                   + B (d_i + c + H) / t                    in_proj's output (conv input, z, dt)
                   + 2 B c / t + 4 H / t                    conv output and its silu; fp32 dt
                   + 4 H (Q + P N / Q) / t + B G Q / t      the chunk's decays, the per-chunk
                                                            states, the C B^T scores
                   + 3 B d_i / t                            scan output, gated input, out_proj input
                   + 3 B f / t                              SwiGLU as in the attention block
          selective: the convolution, scan and gated norm recomputed: in_proj's output and the
                     core's output kept, + B (d_i + c + H) / t + B d_i / t instead
          full:      B h / t_sp                             the block input only
        """
        recompute = recompute or self.recompute
        m, t, b = self.model, self.tp, ACT_BYTES
        h, f, mc = m.d_model, m.ffn_dim, m.mamba
        di, heads, q = mc.d_inner(h), mc.n_heads(h), mc.chunk_size
        c = di + 2 * mc.ngroups * mc.d_state
        if recompute == "full":
            return b * h / self._sp * self.tokens
        shared = 2 * (b * h + 4) / self._sp + 2 * b * h / self._gathered + 3 * b * f / t + b * (di + c + heads) / t
        if recompute == "selective":
            per_token = shared + b * di / t
        else:
            states = 4 * heads * (q + mc.head_dim * mc.d_state / q) + b * mc.ngroups * q
            per_token = shared + (2 * b * c + 4 * heads + states + 3 * b * di) / t
        return per_token * self.tokens

    def blocks_activation_bytes(self, n_blocks: int, first: int | None = None, recompute: str | None = None) -> float:
        kinds = self.block_kinds(n_blocks, first)
        attn = kinds[ATTENTION] * self.layer_activation_bytes(recompute)
        return attn + (kinds[MAMBA] * self.mamba_activation_bytes(recompute) if MAMBA in kinds else 0.0)

    def head_activation_bytes(self) -> float:
        """Saved by the last stage per micro-batch. Eager (the vocabulary-parallel cross
        entropy): final-norm input and rstd, the head input, and the fp32 softmax kept for
        backward. Fused (compiled, tp = 1): the final-norm input and rstd, the bf16 logits, the
        fp32 log-sum-exp and the per-token losses; the normalised input is recomputed."""
        h, v = self.model.d_model, self.local_vocab
        if self.fused_loss:
            per_token = ACT_BYTES * (h + v) + 4 + 4 + 4
        else:
            per_token = (ACT_BYTES * h + 4) / self._sp + ACT_BYTES * h / self._gathered + 4 * v
        return per_token * self.tokens

    def head_transient_bytes(self) -> float:
        """Eager: bf16 logits and their fp32 upcast, alive together while the loss is computed.
        Fused: the bf16 gradient of the logits (the fp32 softmax is never materialised)."""
        per_token = ACT_BYTES if self.fused_loss else ACT_BYTES + 4
        return per_token * self.tokens * self.local_vocab

    def in_flight(self, stage: int) -> int:
        if self.schedule == "afab":
            return self.micro_batches
        return min(self.pp - stage, self.micro_batches)

    def stage_memory(self, stage: int, n_blocks: int, first: int | None = None) -> StageMemory:
        params = self.stage_params(stage, n_blocks, first)
        summed = sums_gradients(self.micro_batches, self.tp * self.pp * self.dp)
        per = bytes_per_param(self.param_precision, self.dp, self.zero1, summed_grads=summed, optimizer=self.optimizer)
        acts = self.blocks_activation_bytes(n_blocks, first)
        transient = 0.0
        if stage == self.pp - 1:
            acts += self.head_activation_bytes()
            transient = self.head_transient_bytes()
            if self.param_precision == "bf16" and not summed:
                transient += 2.0 * self.local_vocab * self.model.d_model  # the head's .grad, made first
        if stage == 0:
            transient = max(transient, 4.0 * self.tokens * self.model.d_model)  # fp32 embedding output
        if self.recompute == "full" and n_blocks:
            kinds = self.block_kinds(n_blocks, first)
            rebuilt = [self.layer_activation_bytes("none")] if kinds[ATTENTION] else []
            rebuilt += [self.mamba_activation_bytes("none")] if kinds.get(MAMBA) else []
            transient += max(rebuilt)  # the block rebuilt for its backward
        return StageMemory(
            params=params,
            weights=params * per.weight,
            grads=params * per.grad,
            optimizer=self.optimizer_state_bytes(stage, n_blocks, first),
            cast=params * per.cast,
            activations_per_micro_batch=acts,
            in_flight=self.in_flight(stage),
            transient=transient,
        )
