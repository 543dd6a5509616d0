"""Per-token reference losses for the proxy's micro-batches: from the frozen reference model
run through the proxy's own parallel layout (online), or from a cache written by `doremi score`.

The cache holds, per domain, a float32 array [num_train_sequences, seq_len] of per-token
reference losses (NaN where not scored) indexed by the sequence's position in the domain's
packed train stream, so it is independent of the layout, the batch size and the step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from trainer.build import autocast, build_model, param_dtype
from data.batch import to_device
from doremi.errors import DoReMiError
from trainer.checkpoint import checkpoint_fingerprint, load_checkpoint, resolve_checkpoint
from trainer.config import TrainerConfig
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import forward_only

CACHE_VERSION = 2


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def freeze(model: torch.nn.Module, cfg: TrainerConfig, pc: ParallelContext) -> torch.nn.Module:
    """`model` frozen in eval mode, its parameters in the dtype a run of `cfg` trains them in
    (`trainer.build.param_dtype`), so that it computes as the run did: bf16 parameters without
    autocast, fp32 ones under it (`trainer.build.autocast`)."""
    dtype = param_dtype(cfg, pc.device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_frozen(cfg: TrainerConfig, checkpoint: Path, pc: ParallelContext) -> torch.nn.Module:
    """The reference model in `cfg`'s layout, loaded from any layout, `freeze`d."""
    model = build_model(cfg, pc)
    load_checkpoint(checkpoint, model, None, pc)
    return freeze(model, cfg, pc)


class OnlineReference:
    """Forward the frozen reference over the proxy's micro-batches (no grad, no activations)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, pc: ParallelContext):
        self.model, self.pc = model, pc
        self.autocast = autocast(cfg, pc.device)

    def __call__(self, step: int, micro_batches: list[dict]) -> None:
        with torch.inference_mode(), self.autocast:
            losses = forward_only(self.model, micro_batches, self.pc)
        for loss, b in zip(losses, micro_batches):
            b["ref_loss"] = loss.float().clone()


def check_fingerprint(meta_path: Path, meta: dict, checkpoint: Path) -> None:
    """The cache was scored with this reference's weights, wherever either lies now: a
    reference trained again to the same path would give wrong losses."""
    want = checkpoint_fingerprint(checkpoint)
    if meta.get("reference_fingerprint") != want:
        raise DoReMiError(f"{meta_path}: cache was scored with reference {meta.get('reference')} (fingerprint "
                          f"{meta.get('reference_fingerprint')}), the run's reference {checkpoint} has fingerprint "
                          f"{want} (run `doremi score` again)")


class CachedReference:
    """Look the reference losses up by (domain, sequence index)."""

    def __init__(self, cache_dir: str | Path, domains: list[str], seq_len: int, device: torch.device,
                 steps: int, global_batch_size: int, seed: int, sampling: list[float],
                 reference: str | None = None):
        """`steps`, `global_batch_size` and `seed` describe the run's data stream; the cache must
        cover it (checked before any work). `reference`: the run's reference, if it names one."""
        self.dir = Path(cache_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise DoReMiError(f"{meta_path}: reference cache not found (run `doremi score` first)")
        meta = json.loads(meta_path.read_text())
        if meta.get("version") != CACHE_VERSION:
            raise DoReMiError(f"{meta_path}: reference cache version {meta.get('version')}, this code reads "
                              f"version {CACHE_VERSION} (run `doremi score` again)")
        if meta.get("domains") != domains or meta.get("seq_len") != seq_len:
            raise DoReMiError(f"{meta_path}: cache was built for domains {meta.get('domains')} and seq_len "
                              f"{meta.get('seq_len')}, the run has {domains} and {seq_len}")
        for key, want in (("global_batch_size", global_batch_size), ("seed", seed)):
            if meta.get(key) != want:
                raise DoReMiError(f"{meta_path}: cache was scored for data.{key if key == 'seed' else 'train.' + key}"
                                  f"={meta.get(key)}, the run has {want} (another data stream)")
        if not np.allclose(meta.get("sampling", []), sampling, rtol=0, atol=1e-12):
            raise DoReMiError(f"{meta_path}: cache was scored for proxy sampling weights {meta.get('sampling')}, "
                              f"the run samples with {list(sampling)} (doremi.proxy_sampling)")
        if meta.get("steps", 0) < steps:
            raise DoReMiError(f"{meta_path}: cache covers {meta.get('steps')} steps, fewer steps than the run's "
                              f"train.steps={steps}")
        if reference is not None:
            check_fingerprint(meta_path, meta, resolve_checkpoint(reference))
        self.arrays = [np.load(self.dir / f"{d}.npy", mmap_mode="r") for d in domains]
        self.domains = domains
        self.device = device

    def __call__(self, step: int, micro_batches: list[dict]) -> None:
        for b in micro_batches:
            items = b["items"].tolist()  # host tensor: no device sync
            rows = [self.arrays[d][i] for d, i in items]
            ref = torch.from_numpy(np.stack(rows).astype(np.float32))
            if torch.isnan(ref).any():
                d, i = next((d, i) for (d, i), r in zip(items, rows) if np.isnan(r).any())
                raise DoReMiError(f"{self.dir}: no cached reference loss for {self.domains[d]} sequence {i} "
                                  f"at step {step} (the cache covers fewer steps than the run)")
            b["ref_loss"] = to_device({"r": ref}, self.device)["r"]
