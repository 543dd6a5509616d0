"""The trainer's config sections as typed dataclasses, and the loader for an experiment file.

Sections: `model`, `data` (owned by `data.config`), `train`, `parallelism`, `checkpoint`,
`logging`. The `doremi` layer extends `TrainerConfig` with its own section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from data.config import DataConfig, PathStr
from data.store.store import MANIFEST_FILE, read_manifest
from trainer.config.fp8 import Fp8Config, check_fp8_layers
from trainer.config.launch_env import launch_world_size, launched
from trainer.config.mamba import MambaConfig, check_block_pattern, check_mamba_tp
from trainer.config.moe import MoEConfig, check_moe_layout
from trainer.config.mup import MupConfig
from trainer.config.presets import PRESETS
from trainer.config.tools import ConfigError, apply_overrides, from_dict, read_yaml


@dataclass
class RopeScaling:
    """Llama-3 RoPE frequency scaling (Meta, Llama 3.1 release)."""

    # How much longer than original_max_position the context becomes.
    factor: float = 8.0
    # Wavelengths above original_max_position / low_freq_factor are scaled by `factor`.
    low_freq_factor: float = 1.0
    # Wavelengths below original_max_position / high_freq_factor are kept.
    high_freq_factor: float = 4.0
    # The context length the model was first trained at.
    original_max_position: int = 8192


@dataclass
class ModelConfig:
    """The Llama model's shape. Keys given next to a preset override the preset's."""

    # A named shape (trainer/config/presets.py; `doremi config --presets` lists them).
    preset: str | None = None
    # Embedding rows, at least the tokenizer's vocabulary. `auto`: the stores' tokenizer's
    # (data.store_dir's manifest.json), resolved when the config is loaded and the stores exist;
    # a stage that builds the model before `doremi preprocess` then stops with one line.
    vocab_size: int | Literal["auto"] = "auto"
    # Hidden size.
    d_model: int = 64
    # Transformer blocks.
    n_layers: int = 2
    # Attention heads (d_model / n_heads is the head dimension; even, for RoPE).
    n_heads: int = 4
    # Key/value heads (grouped-query attention); a divisor of n_heads.
    n_kv_heads: int = 2
    # SwiGLU hidden size.
    ffn_dim: int = 128
    # Longest sequence the RoPE tables cover (data.seq_len at most this).
    max_seq_len: int = 256
    # RoPE base frequency.
    rope_theta: float = 10000.0
    # Llama-3 long-context RoPE scaling; None: none.
    rope_scaling: RopeScaling | None = None
    # RMSNorm epsilon.
    norm_eps: float = 1e-5
    # Share the input embedding with the LM head.
    tie_embeddings: bool = False
    # Standard deviation of the normal initialisation of the weights.
    init_std: float = 0.02
    # Scale output projections (attention out, FFN down) by 1/sqrt(2 * n_layers) (GPT-2 style).
    depth_scaled_init: bool = True
    # Attention kernel: `sdpa` (torch), `flash` (flash-attn), `auto` (flash when installed on CUDA).
    attention: Literal["auto", "sdpa", "flash"] = "auto"
    # torch.compile (GPU only; ignored on CPU): see trainer.model.llama.compile_scope.
    compile: bool = False
    # Initial weights from a Hugging Face Llama directory (`doremi import` prints the matching
    # model section); None: random (init_std). Not read when the run resumes or loads a checkpoint.
    init_from_hf: PathStr | None = None
    # Mixer of each layer, tiled over n_layers: A attention, M Mamba-2 (e.g. `MMMA`); empty: all
    # attention (trainer/config/mamba.py).
    block_pattern: str = ""
    # The Mamba-2 mixer of the M layers.
    mamba: MambaConfig = field(default_factory=MambaConfig)
    # Mixture-of-experts MLPs (trainer/model/moe.py); None: dense SwiGLU in every block.
    moe: MoEConfig | None = None
    # FP8 GEMMs in chosen linears (trainer/model/fp8.py, on torchao: `pip install -e .[fp8]`);
    # None: all in the parameters' precision.
    fp8: Fp8Config | None = None
    # Spectral muP relative to a base width (trainer/model/mup.py); None: standard parametrization.
    mup: MupConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, path: str = "model") -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"{path}.preset: expected one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) != "auto" and getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected a positive int, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"{path}.d_model: expected a multiple of n_heads={self.n_heads}, got {self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{path}.n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{path}.d_model: head dimension {self.head_dim} must be even for RoPE")
        check_block_pattern(self, path)
        if self.moe is not None:
            self.moe.validate(f"{path}.moe")
        if self.fp8 is not None:
            self.fp8.validate(f"{path}.fp8")
            check_fp8_layers(self, path)
        if self.mup is not None:
            self.mup.validate(f"{path}.mup", self.tie_embeddings)


@dataclass
class TrainConfig:
    """The optimizer, its schedule, the batch and where the run writes."""

    # Optimizer steps.
    steps: int = 100
    # Sequences per optimizer step over all data-parallel ranks and micro-batches.
    global_batch_size: int = 8
    # Gradient-accumulation steps per optimizer step on each data-parallel rank (pipeline
    # micro-batches under pp > 1): each is global_batch_size / (dp x micro_batches) sequences.
    micro_batches: int = 1
    # `adamw`, or `adafactor` (factored second moments: less optimizer memory).
    optimizer: Literal["adamw", "adafactor"] = "adamw"
    # Peak learning rate, reached after the warmup.
    lr: float = 1e-3
    # Learning rate at the end of the decay.
    min_lr: float = 1e-4
    # Share of train.steps spent warming up linearly (unless warmup_steps is given).
    warmup_fraction: float = 0.06
    # Warmup steps; None: warmup_fraction x steps.
    warmup_steps: int | None = None
    # Shape of the decay from lr to min_lr after the warmup.
    decay: Literal["cosine", "linear", "exponential", "constant"] = "cosine"
    # Decoupled weight decay (not applied to norms and biases).
    weight_decay: float = 0.01
    # Decay rate of the optimizer's first moment.
    beta1: float = 0.9
    # Decay rate of the optimizer's second moment.
    beta2: float = 0.95
    # Added to the second moment's square root in the update's denominator.
    eps: float = 1e-8
    # Clip the global gradient norm to this (0: off).
    grad_clip: float = 1.0
    # Seed of the initialisation and of the per-rank random states.
    seed: int = 0
    # Deterministic kernels (trainer/run/determinism.py): a GPU run becomes a function of its seeds,
    # bitwise, at about 0.8x the throughput. On for studies, where arms must differ only in the mixture.
    deterministic: bool = False
    # `auto`: bf16 autocast on CUDA (or with param_dtype bf16), fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Parameter storage. bf16: bf16 parameters, fp32 main grads, fp32 master weights and AdamW
    # moments (trainer.optim.master_weights). `auto`: bf16 when the compute precision resolves to bf16
    # and the optimizer is adamw, fp32 otherwise (trainer.plan.resolve.param_dtype).
    param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # `auto`: cuda when available, else cpu; cpu in a gloo process group made before the trainer
    # joins it (the multi-process tests; trainer.parallel.context.resolve_device).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Steps between validation evaluations (0: only at the end).
    eval_every: int = 0
    # Validation sequences per domain (0: the whole validation split), the same set whatever the layout.
    eval_sequences: int = 64
    # Each evaluated sequence's loss sum, label tokens and documents, per domain, in
    # `eval_sequences/step_NNNNNNN.npz` of the run directory (trainer/records/eval_sequences.py), for
    # standard errors clustered by document: `off`, at the `final` evaluation, or at `every` one.
    # When on, the logged val_loss is the exact sum of those (a last-bit difference from `off`).
    eval_sequence_losses: Literal["off", "final", "every"] = "off"
    # None: `doremi <stage> CONFIG` uses runs/<CONFIG stem>/<stage> (doremi.pipeline.stages.default_run_dir),
    # so that two stages or two configs never share a directory unless told to.
    run_dir: PathStr | None = None
    # A resume to more train.steps than a finished run had, when the schedule depends on
    # train.steps: `refuse` (re-stretching it would jump the rate back up, e.g. 1e-4 -> 6.4e-4),
    # `continue_at_min_lr` (the added steps stay at the finished schedule's final rate) or
    # `restart_schedule` (a new warmup and decay over the added steps); trainer/run/schedule_extension.py.
    extend: Literal["refuse", "continue_at_min_lr", "restart_schedule"] = "refuse"

    def validate(self, path: str = "train") -> None:
        if self.steps < 1:
            raise ConfigError(f"{path}.steps: expected >= 1, got {self.steps}")
        if self.global_batch_size < 1 or self.micro_batches < 1:
            raise ConfigError(f"{path}.global_batch_size/micro_batches: expected >= 1")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"{path}.min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"{path}.warmup_fraction: expected a value in [0, 1), got {self.warmup_fraction}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"{path}.warmup_steps: expected >= 0, got {self.warmup_steps}")
        if self.decay == "exponential" and self.min_lr <= 0:
            raise ConfigError(f"{path}.min_lr: exponential decay needs min_lr > 0, got {self.min_lr}")
        for name in ("eval_every", "eval_sequences"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: expected >= 0, got {getattr(self, name)}")
        if self.param_dtype == "bf16" and self.optimizer != "adamw":
            raise ConfigError(
                f"{path}.param_dtype: bf16 parameters keep fp32 master weights in AdamW only, "
                f"got {path}.optimizer={self.optimizer!r} (use param_dtype fp32 or auto)"
            )
        if self.param_dtype == "bf16" and self.precision == "fp32":
            raise ConfigError(
                f"{path}.param_dtype: bf16 parameters compute in bf16, got {path}.precision='fp32' "
                f"(use precision bf16 or auto)"
            )
        if self.grad_clip < 0 or self.eps <= 0 or not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ConfigError(
                f"{path}: expected grad_clip >= 0, eps > 0 and betas in [0, 1), got grad_clip="
                f"{self.grad_clip}, eps={self.eps}, beta1={self.beta1}, beta2={self.beta2}"
            )


def auto_dp(tp: int, pp: int, path: str = "parallelism") -> int:
    """`dp: auto`: the processes the launcher started over those one replica needs (as
    torchtitan infers it), so that a config need not be edited for each node count; 1 without
    a launcher (no WORLD_SIZE), as the former default, so that a tp > 1 config still plans and
    inspects off the cluster."""
    if not launched():
        return 1
    world = launch_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConfigError(
            f"{path}.dp: auto needs WORLD_SIZE divisible by tp x pp = {tp} x {pp}, got WORLD_SIZE={world} "
            f"(or give dp as a number)"
        )
    return world // (tp * pp)


def _auto_dp_note(tp: int, pp: int, dp: int) -> str | None:
    if not launched():
        return None
    grid = f"tp {tp}" + (f" x pp {pp}" if pp > 1 else "")
    return f"dp {dp} (auto: WORLD_SIZE {launch_world_size()} / {grid})"


#: Where a section keeps what its `auto` values resolved to (an attribute, not a config key:
#: never in `to_dict`, so a fingerprint hashes the resolved value only).
_AUTO_NOTE = "_auto_note"


def _set_auto_note(section: object, note: str | None) -> None:
    if note:
        section.__dict__[_AUTO_NOTE] = note


def auto_notes(cfg: TrainerConfig) -> list[str]:
    """What `auto` defaults resolved to and from where (`vocab_size 50277 (auto: from the
    stores)`, `dp 4 (auto: WORLD_SIZE 8 / tp 2)`), for the run's start-up line (issue 43 item 4):
    a value the framework chose is said, not silently used."""
    return [n for section in (cfg.model, cfg.parallelism) if (n := section.__dict__.get(_AUTO_NOTE))]


@dataclass
class ParallelismConfig:
    """The process grid: world size = tp x pp x dp (docs/design.md section 5)."""

    # Tensor-parallel degree: a divisor of model.n_kv_heads and model.ffn_dim.
    tp: int = 1
    # Pipeline stages (at most model.n_layers).
    pp: int = 1
    # Data-parallel replicas. `auto`: the launcher's WORLD_SIZE / (tp x pp) (1 without torchrun),
    # resolved when the section is made; an error when it does not divide.
    dp: int | Literal["auto"] = "auto"
    # Megatron sequence parallelism of the norms and dropout-free regions (needs tp > 1 to matter).
    sequence_parallel: bool = False
    # Overlap tensor-parallel communication with compute.
    tp_async: bool = False
    # Redo the sequence-parallel all-gather in the backward instead of keeping its output.
    tp_recompute_allgather: bool = False
    # `1f1b` (one forward one backward) or `afab` (all forwards, then all backwards).
    pp_schedule: Literal["1f1b", "afab"] = "1f1b"
    # Layers per pipeline stage; empty: chosen by the compute-and-memory cost model.
    pp_layers: list[int] = field(default_factory=list)
    # Expert-parallel degree: the MoE experts split over groups of this many data-parallel
    # ranks (a divisor of dp and of model.moe.num_experts; trainer/parallel/expert.py).
    ep: int = 1
    # Shard the optimizer state over the data-parallel ranks (ZeRO-1).
    zero1: bool = True
    # Activation recomputation: `selective` (attention), `full` (each block), or `none`.
    recompute: Literal["none", "selective", "full"] = "none"
    # Process-group backend; `auto`: nccl on CUDA, gloo on CPU.
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    def __post_init__(self) -> None:
        """`dp: auto` resolved as soon as the section exists, also when built in code or by a
        default factory (a config without a parallelism section), so that no reader sees `auto`."""
        self._resolve_dp("parallelism")

    def _resolve_dp(self, path: str) -> None:
        if self.dp == "auto" and isinstance(self.tp, int) and isinstance(self.pp, int) and min(self.tp, self.pp) >= 1:
            self.dp = auto_dp(self.tp, self.pp, path)
            _set_auto_note(self, _auto_dp_note(self.tp, self.pp, self.dp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp  # type: ignore[operator]

    def validate(self, path: str = "parallelism") -> None:
        for name in ("tp", "pp", "dp"):
            if name == "dp":
                self._resolve_dp(path)
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected >= 1, got {getattr(self, name)}")
        if self.pp_layers and len(self.pp_layers) != self.pp:
            raise ConfigError(
                f"{path}.pp_layers: expected {self.pp} entries (one per stage), got {len(self.pp_layers)}"
            )


@dataclass
class CheckpointConfig:
    """When a run saves, what it keeps, and how it resumes (docs/design.md section 6)."""

    # Steps between periodic checkpoints (0: only at the end and on SIGINT/SIGTERM). 1000 bounds
    # what a preemption without a grace period loses to minutes on the proxy and main runs of
    # docs/design.md, and a save (one sharded write) is small next to 1000 optimizer steps.
    every: int = 1000
    # Checkpoints kept in the run directory (older ones are removed).
    keep: int = 2
    # Resume from the latest checkpoint in the run directory when one exists.
    resume: bool = True
    # Start from this checkpoint (a run or checkpoint directory) instead of the run directory's own.
    load: PathStr | None = None
    # Resume even when a key that determines results (trainer.records.run_dir.result_keys) differs
    # from the checkpoint's; off: such a resume stops with the keys that differ.
    resume_changed: bool = False
    # Move what the run directory holds to RUN.old-<time> and start from step 0; off: a run
    # with resume false refuses a directory that holds checkpoints.
    start_over: bool = False

    def validate(self, path: str = "checkpoint") -> None:
        if self.every < 0:
            raise ConfigError(f"{path}.every: expected >= 0 (0: only at the end), got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"{path}.keep: expected >= 1, got {self.keep}")


@dataclass
class LoggingConfig:
    """What a run prints and where its metrics go besides metrics.jsonl."""

    # Steps between logged metrics.
    every: int = 1
    # True: a progress bar when stderr is a terminal; otherwise (or false) one plain line per
    # logged step (step, loss, tokens/s), so that a log file gets lines and a run is never silent.
    progress: bool = True
    # Also log to Weights & Biases (`pip install -e .[wandb]`); a resumed run continues the same
    # wandb run (its id is kept in the run directory's `wandb_id`).
    wandb: bool = False
    # Also log scalars for TensorBoard to <run_dir>/tensorboard/ (`pip install -e .[tensorboard]`).
    tensorboard: bool = False
    # The wandb project.
    wandb_project: str = "doremi"
    # None: `<stage>:<run dir>`.
    run_name: str | None = None
    # Groups the wandb runs of one pipeline; None: the pipeline's run directory name, found by
    # doremi.pipeline.stages for stages the pipeline runs, no group for a standalone stage.
    wandb_group: str | None = None

    def validate(self, path: str = "logging") -> None:
        if self.every < 1:
            raise ConfigError(f"{path}.every: expected >= 1, got {self.every}")


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def budget_tokens(self) -> int:
        """Tokens the run trains on: what a `unimax:E` mixture caps its epochs against."""
        return self.train.steps * self.train.global_batch_size * self.data.seq_len

    def validate(self, path: str = "") -> None:
        m, p, t = self.model, self.parallelism, self.train
        if m.vocab_size == "auto" and (found := stores_vocab_size(self.data.store_dir)) is not None:
            m.vocab_size = found
            _set_auto_note(m, f"vocab_size {found} (auto: from the stores)")
        if m.n_kv_heads % p.tp:
            raise ConfigError(f"parallelism.tp: expected a divisor of model.n_kv_heads={m.n_kv_heads}, got {p.tp}")
        check_mamba_tp(m, p.tp)
        check_moe_layout(m.moe, m.n_layers, m.ffn_dim, p.tp, p.dp, p.ep)
        if m.ffn_dim % p.tp:
            raise ConfigError(f"parallelism.tp: expected a divisor of model.ffn_dim={m.ffn_dim}, got {p.tp}")
        if p.pp > m.n_layers:
            raise ConfigError(f"parallelism.pp: expected at most model.n_layers={m.n_layers} stages, got {p.pp}")
        if p.pp_layers and sum(p.pp_layers) != m.n_layers:
            raise ConfigError(
                f"parallelism.pp_layers: expected entries summing to model.n_layers={m.n_layers}, got {p.pp_layers}"
            )
        if p.pp > 1 and t.micro_batches < p.pp:
            raise ConfigError(
                f"train.micro_batches: pipeline parallel with pp={p.pp} needs at least {p.pp} "
                f"micro-batches per step, got {t.micro_batches}"
            )
        if t.global_batch_size % (p.dp * t.micro_batches):
            raise ConfigError(
                f"train.global_batch_size: expected a multiple of parallelism.dp x train.micro_batches "
                f"= {p.dp * t.micro_batches}, got {t.global_batch_size}"
            )
        if p.sequence_parallel and p.tp > 1 and self.data.seq_len % p.tp:
            raise ConfigError(
                f"data.seq_len: expected a multiple of parallelism.tp={p.tp} with sequence parallel, got {self.data.seq_len}"
            )
        if self.data.seq_len > m.max_seq_len:
            raise ConfigError(
                f"data.seq_len: expected at most model.max_seq_len={m.max_seq_len}, got {self.data.seq_len}"
            )


C = TypeVar("C", bound=TrainerConfig)


def stores_vocab_size(store_dir: str) -> int | None:
    """The vocabulary size of the tokenizer the stores at `store_dir` were built with; None
    before `doremi preprocess` has built them (`model.vocab_size: auto` then stays `auto`
    until a stage that needs the model finds the stores; `require_vocab_size`)."""
    manifest = Path(store_dir) / MANIFEST_FILE
    if not manifest.is_file():
        return None
    return int(read_manifest(store_dir).tokenizer["vocab_size"])


def require_vocab_size(cfg: TrainerConfig) -> int:
    """`model.vocab_size` as a number, or the one-line error that says how to get one."""
    if cfg.model.vocab_size == "auto":
        raise ConfigError(
            f"model.vocab_size: auto takes the tokenizer's vocabulary from the token stores, but "
            f"{Path(cfg.data.store_dir) / MANIFEST_FILE} does not exist; run `doremi preprocess` "
            f"first or give a number"
        )
    return cfg.model.vocab_size


def apply_preset(raw: dict[str, Any]) -> None:
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("preset"), str) and model["preset"] in PRESETS:
        merged = dict(PRESETS[model["preset"]])
        for key, value in model.items():
            nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
            merged[key] = {**merged[key], **value} if nested else value
        raw["model"] = merged


def model_config(**section: Any) -> ModelConfig:
    """The `model` section `section` read as `load_config` reads it (its preset's keys under the
    given ones, then checked): one model's config for what builds a model without an experiment
    file, such as the benches and the tests."""
    raw = {"model": section}
    apply_preset(raw)
    return from_dict(ModelConfig, raw["model"], "model")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None, cls: type[C] = TrainerConfig) -> C:  # type: ignore[assignment]
    """Read YAML, apply `--set` overrides, resolve the model preset, validate, return `cls`."""
    raw = read_yaml(path) if path is not None else {}
    apply_overrides(raw, overrides or [])
    apply_preset(raw)
    return from_dict(cls, raw)
