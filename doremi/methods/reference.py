"""Per-token reference losses for the proxy's micro-batches: from the frozen reference model
run through the proxy's own parallel layout (online), or from a cache written by `doremi score`
(its format: `doremi.methods.reference_cache`). Shared by the catalog's methods that need a
reference (`MethodSpec.needs_reference`; their options name it, `registry.reference_options`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from data.batch import to_device
from data.store import MANIFEST_FILE, read_manifest
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


class OnlineReference:
    """Forward the frozen reference over the proxy's micro-batches (no grad, no activations)."""

    def __init__(self, model: torch.nn.Module, facts: RunFacts, pc: ParallelContext):
        """`facts`: those of the reference's config (its autocast)."""
        self.model, self.pc = model, pc
        self.autocast = facts.autocast()

    def __call__(self, step: int, micro_batches: list[dict]) -> None:
        with torch.inference_mode(), self.autocast:
            losses = forward_only(self.model, micro_batches, self.pc)
        for loss, b in zip(losses, micro_batches):
            b["ref_loss"] = loss.float().clone()


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
