"""Per-token reference losses for the proxy's micro-batches: from the frozen reference model
run through the proxy's own parallel layout (online), or from a cache written by `doremi score`
(its format: `doremi.methods.reference_cache`). Shared by the catalog's methods that need a
reference (`MethodSpec.needs_reference`; their options name it, `registry.reference_options`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from data.store.batch import to_device
from data.store.store import MANIFEST_FILE, read_manifest
from doremi.config import ExperimentConfig, load_saved_config
from doremi.errors import DoReMiError
from doremi.methods.reference_cache import CACHE_VERSION  # noqa: F401 (imported from here by tests)
from doremi.methods.registry import reference_method, reference_options
from trainer.build import RunFacts, build_model
from trainer.checkpoint.checkpoint import load_checkpoint, resolve_checkpoint
from trainer.config.schema import TrainerConfig
from trainer.config.tools import ConfigError
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import forward_only
from trainer.records.run_dir import RECORD_FILE, require_finished

C = TypeVar("C", bound=TrainerConfig)


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def stores_identity(store_dir: str) -> dict | None:
    """The identity of the stores in `store_dir`; None where there are none to compare."""
    manifest = Path(store_dir) / MANIFEST_FILE
    return read_manifest(store_dir).identity() if manifest.is_file() else None


def freeze(model: torch.nn.Module, facts: RunFacts) -> torch.nn.Module:
    """`model` frozen in eval mode, its parameters in the dtype its run trains them in
    (`facts.param_dtype`), so that it computes as the run did: bf16 parameters without
    autocast, fp32 ones under it (`facts.autocast`)."""
    for p in model.parameters():
        p.data = p.data.to(facts.param_dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_frozen(
    cfg: TrainerConfig, checkpoint: Path, pc: ParallelContext, facts: RunFacts | None = None
) -> torch.nn.Module:
    """The reference model in `cfg`'s layout, loaded from any layout, `freeze`d. `facts`: those
    of `cfg` (resolved here when not given). The checkpoint must have been trained on the stores
    of `cfg.data.store_dir` (`trainer.checkpoint.checkpoint.check_data`): a model evaluated, or used as a
    reference, on stores rebuilt from other inputs gives a plausible but wrong loss."""
    facts = facts or RunFacts.resolve(cfg, pc)
    model = build_model(cfg, pc, facts)
    load_checkpoint(checkpoint, model, None, pc, data=stores_identity(cfg.data.store_dir))
    return freeze(model, facts)


def reference_config(cfg: ExperimentConfig, checkpoint: Path) -> ExperimentConfig:
    """The proxy's layout and data with the reference run's model shape."""
    saved = run_dir_of(checkpoint) / "config.yaml"
    if not saved.is_file():
        raise DoReMiError(f"{saved}: the reference run's config.yaml is missing")
    ref = load_saved_config(saved)
    if ref.data.seq_len != cfg.data.seq_len:
        raise DoReMiError(
            f"{saved}: reference data.seq_len={ref.data.seq_len} differs from the proxy's {cfg.data.seq_len}"
        )
    tokenizer = read_manifest(cfg.data.store_dir).tokenizer
    if ref.model.vocab_size < int(tokenizer["vocab_size"]):
        raise DoReMiError(
            f"{saved}: reference model.vocab_size={ref.model.vocab_size} is smaller than the "
            f"proxy's tokenizer ({tokenizer['vocab_size']} ids)"
        )
    if Path(ref.data.store_dir).joinpath("manifest.json").is_file():
        ref_tokenizer = read_manifest(ref.data.store_dir).tokenizer
        if ref_tokenizer.get("hash") != tokenizer.get("hash"):
            raise DoReMiError(
                f"{saved}: the reference was trained with tokenizer {ref_tokenizer.get('name')} "
                f"({ref_tokenizer.get('hash')}), the proxy's stores use {tokenizer.get('name')} "
                f"({tokenizer.get('hash')})"
            )
    return dataclasses.replace(cfg, model=ref.model)


def fp8_reference(cfg: C, path: str) -> C:
    """`cfg` (a reference's, `reference_config`) with the forward GEMMs of its linears in FP8
    (`mixing.<method>.reference_fp8`; `trainer.model.fp8`, torchao's tensorwise recipe with
    dynamic scaling): the frozen reference's forward is a quarter of the proxy step's FLOPs and
    FP8 GEMMs run them faster on Hopper (docs/design.md section 4, "The online reference's
    cost"). A reference that trained
    in FP8 keeps its own `model.fp8`; otherwise every linear with an FP8 path (attention's where
    the model has attention, the MLP's unless its experts replace it; the head stays in bf16)."""
    from trainer.config.fp8 import FP8_LAYERS, Fp8Config
    from trainer.config.mamba import ATTENTION, layer_mixers

    model = cfg.model
    if model.fp8 is not None:
        return cfg
    attention = ATTENTION in layer_mixers(model.block_pattern, model.n_layers)
    layers = [n for n in FP8_LAYERS if (attention if n in ("qkv", "proj") else model.moe is None)]
    if not layers:
        raise ConfigError(f"{path}: the reference model has no linear with an FP8 path (no attention, MoE experts)")
    return dataclasses.replace(cfg, model=dataclasses.replace(model, fp8=Fp8Config(layers=layers)))


def require_reference(cfg: ExperimentConfig) -> Path:
    """The reference checkpoint. A reference named by its run directory must have finished and
    not be training still (`trainer.records.run_dir.require_finished`; docs/design.md section 6b); a
    checkpoint directory named explicitly is read as it is."""
    reference = reference_options(cfg).reference
    if not reference:
        raise ConfigError(
            f"mixing.{reference_method(cfg)}.reference: required (the reference run directory or checkpoint), got nothing"
        )
    if (Path(reference) / RECORD_FILE).is_file():
        require_finished(reference, "reference")
    return resolve_checkpoint(reference)


def matmul_weights_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every column- and row-parallel linear's weight of a frozen `model` in `dtype`, the
    dtype autocast computes its matmuls in; returns how many changed. Under autocast an fp32
    weight is cast to bf16 at every forward (the reference's weights read and written once
    more per step, docs/design.md section 4 "The online reference's cost"); the linears cast
    their weight to the autocast dtype themselves (`trainer.parallel.tensor._compute_dtype`,
    or autocast's own F.linear rule), to the same values, so the losses do not change. Norms,
    embeddings (a tied head included), the MoE router and Mamba's own parameters keep theirs."""
    from trainer.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    n = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight.dtype != dtype:
            module.weight.data = module.weight.data.to(dtype)
            n += 1
    return n


def fp8_weights_once(model: torch.nn.Module) -> int:
    """Cast the weight of every FP8 linear of a frozen `model` that torchao runs whole (tp 1,
    dynamic scaling) to FP8 once (`trainer.model.fp8.Fp8Matmul.freeze_weight`), instead of an
    amax and a cast of each weight at every forward; the same FP8 values. Returns how many.
    Call it after `matmul_weights_in`: the copy is cast from the weight in its compute dtype."""
    n = 0
    for module in model.modules():
        mm = getattr(module, "fp8", None)
        if mm is not None and mm.whole and mm.tp.size == 1:
            mm.freeze_weight(module.weight)
            n += 1
    return n


class OnlineReference:
    """Forward the frozen reference over the proxy's micro-batches (no grad, no activations)."""

    def __init__(self, model: torch.nn.Module, facts: RunFacts, pc: ParallelContext):
        """`facts`: those of the reference's config (its autocast). Under autocast (fp32
        parameters computing in bf16) the linears' weights are kept in bf16 (`matmul_weights_in`);
        FP8 linears' weights are cast to FP8 once (`fp8_weights_once`)."""
        self.model, self.pc = model, pc
        self.autocast = facts.autocast()
        if isinstance(self.autocast, torch.autocast):
            matmul_weights_in(model, self.autocast.fast_dtype)
        fp8_weights_once(model)

    def __call__(self, step: int, micro_batches: list[dict]) -> None:
        """Under `no_grad` (`forward_only`'s), not `inference_mode`: the same kernels, and torchao's
        FP8 tensors with rowwise scales refuse the reshape that inference mode leaves undecomposed
        (a reference trained with `model.fp8.scaling: rowwise`)."""
        with self.autocast:
            losses = forward_only(self.model, micro_batches, self.pc)
        for loss, b in zip(losses, micro_batches):
            b["ref_loss"] = loss.float()


class CachedReference:
    """Look the reference losses up by (domain, sequence index)."""

    def __init__(self, cache_dir: str | Path, domains: list[str], arrays: list[np.ndarray], device: torch.device):
        """`arrays`: each domain's losses as `open_cache` returns them, once it has checked that
        the cache covers the run's data stream (before any work); its parameters are not repeated
        here, so that what a cache is checked against has one owner."""
        self.dir = Path(cache_dir)
        self.arrays = arrays
        self.domains = domains
        self.device = device

    def __call__(self, step: int, micro_batches: list[dict]) -> None:
        for b in micro_batches:
            items = b["items"].tolist()  # host tensor: no device sync
            rows = [self.arrays[d][i] for d, i in items]
            ref = torch.from_numpy(np.stack(rows).astype(np.float32))
            if torch.isnan(ref).any():
                d, i = next((d, i) for (d, i), r in zip(items, rows) if np.isnan(r).any())
                raise DoReMiError(
                    f"{self.dir}: no cached reference loss for {self.domains[d]} sequence {i} "
                    f"at step {step} (the cache covers fewer steps than the run)"
                )
            b["ref_loss"] = to_device({"r": ref}, self.device)["r"]
