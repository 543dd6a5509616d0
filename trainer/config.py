"""The trainer's config sections as typed dataclasses, and the loader for an experiment file.

Sections: `model`, `data` (owned by `data.config`), `train`, `parallelism`, `checkpoint`,
`logging`. The `doremi` layer extends `TrainerConfig` with its own section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from data.config import DataConfig
from trainer.configtools import ConfigError, apply_overrides, from_dict, read_yaml
from trainer.model.presets import PRESETS


@dataclass
class RopeScaling:
    """Llama-3 RoPE frequency scaling (Meta, Llama 3.1 release)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class ModelConfig:
    preset: str | None = None
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Scale output projections (attention out, FFN down) by 1/sqrt(2 * n_layers) (GPT-2 style).
    depth_scaled_init: bool = True
    attention: Literal["auto", "sdpa", "flash"] = "auto"
    # torch.compile (GPU only; ignored on CPU): see trainer.model.llama.compile_scope.
    compile: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, path: str = "model") -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"{path}.preset: expected one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected a positive int, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"{path}.d_model: expected a multiple of n_heads={self.n_heads}, got {self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{path}.n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{path}.d_model: head dimension {self.head_dim} must be even for RoPE")


@dataclass
class TrainConfig:
    steps: int = 100
    # Sequences per optimizer step over all data-parallel ranks and micro-batches.
    global_batch_size: int = 8
    micro_batches: int = 1
    optimizer: Literal["adamw", "adafactor"] = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_fraction: float = 0.06
    warmup_steps: int | None = None
    decay: Literal["cosine", "linear", "exponential", "constant"] = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    # `auto`: bf16 autocast on CUDA (or with param_dtype bf16), fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Parameter storage. bf16: bf16 parameters, fp32 main grads, fp32 master weights and AdamW
    # moments (trainer.optim.master_weights). `auto`: bf16 when the compute precision resolves to bf16
    # and the optimizer is adamw, fp32 otherwise (trainer.build.param_dtype).
    param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_every: int = 0
    # Validation sequences per domain (0: the whole validation split), the same set whatever the layout.
    eval_sequences: int = 64
    run_dir: str = "runs/train"

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


@dataclass
class ParallelismConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    tp_async: bool = False
    tp_recompute_allgather: bool = False
    pp_schedule: Literal["1f1b", "afab"] = "1f1b"
    # Layers per pipeline stage; empty: chosen by the compute-and-memory cost model.
    pp_layers: list[int] = field(default_factory=list)
    zero1: bool = True
    recompute: Literal["none", "selective", "full"] = "none"
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self, path: str = "parallelism") -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected >= 1, got {getattr(self, name)}")
        if self.pp_layers and len(self.pp_layers) != self.pp:
            raise ConfigError(
                f"{path}.pp_layers: expected {self.pp} entries (one per stage), got {len(self.pp_layers)}"
            )


@dataclass
class CheckpointConfig:
    every: int = 0
    keep: int = 2
    # Resume from the latest checkpoint in the run directory when one exists.
    resume: bool = True
    load: str | None = None
    # Resume even when a key that determines results (trainer.run_dir.result_keys) differs
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
    every: int = 1
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "doremi"
    run_name: str | None = None

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

    def validate(self, path: str = "") -> None:
        m, p, t = self.model, self.parallelism, self.train
        if m.n_kv_heads % p.tp:
            raise ConfigError(f"parallelism.tp: expected a divisor of model.n_kv_heads={m.n_kv_heads}, got {p.tp}")
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


def apply_preset(raw: dict[str, Any]) -> None:
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("preset"), str) and model["preset"] in PRESETS:
        merged = dict(PRESETS[model["preset"]])
        merged.update(model)
        raw["model"] = merged


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None, cls: type[C] = TrainerConfig) -> C:  # type: ignore[assignment]
    """Read YAML, apply `--set` overrides, resolve the model preset, validate, return `cls`."""
    raw = read_yaml(path) if path is not None else {}
    apply_overrides(raw, overrides or [])
    apply_preset(raw)
    return from_dict(cls, raw)
