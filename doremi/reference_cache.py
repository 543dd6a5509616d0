"""The reference cache that `doremi score` writes and a proxy with `doremi.reference_cache`
reads: its layout, its `meta.json` fields and their checks live here only.

Per domain, `<domain>.npy` holds a float32 array [num_train_sequences, seq_len] of per-token
reference losses (NaN where not scored) indexed by the sequence's position in the domain's packed
train stream, so it is independent of the layout, the batch size and the step. `meta.json` holds
`version`, the proxy data stream the cache covers (`domains`, `seq_len`, `steps`,
`global_batch_size`, `seed`, `sampling`), the reference it was scored with (`reference`, and
`reference_fingerprint`: a reference trained again to the same path does not pass for the one
scored) and `sequences` (per domain, how many were scored). The cache is built in `<dir>.tmp` and
renamed into place, so that a `doremi score` cut short leaves nothing that looks like a cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from data.atomic import atomic_write_text
from doremi.errors import DoReMiError
from trainer.checkpoint import checkpoint_fingerprint, resolve_checkpoint

CACHE_VERSION = 2
META_FILE = "meta.json"


def _array_path(cache_dir: Path, domain: str) -> Path:
    return cache_dir / f"{domain}.npy"


def staging_dir(out: Path) -> Path:
    """Where `doremi score` builds the cache that `publish` then moves to `out`."""
    return out.with_name(out.name + ".tmp")


def create_arrays(staging: Path, domains: list[str], num_sequences: list[int], seq_len: int) -> None:
    """One all-NaN array per domain (nothing scored yet)."""
    staging.mkdir(parents=True, exist_ok=True)
    for name, n in zip(domains, num_sequences):
        arr = np.lib.format.open_memmap(_array_path(staging, name), mode="w+", dtype=np.float32, shape=(n, seq_len))
        arr[:] = np.nan
        arr.flush()
        del arr


def open_for_scoring(staging: Path, domain: str) -> np.ndarray:
    """A domain's array, memory-mapped for writing the losses of the sequences scored."""
    return np.load(_array_path(staging, domain), mmap_mode="r+")


def reference_stamp(checkpoint: Path) -> dict[str, str]:
    """The reference a cache is scored with: its path, and the fingerprint of its weights."""
    return {"reference": str(checkpoint), "reference_fingerprint": checkpoint_fingerprint(checkpoint)}


def publish(
    staging: Path,
    out: Path,
    domains: list[str],
    seq_len: int,
    reference: dict[str, str],
    steps: int,
    global_batch_size: int,
    seed: int,
    sampling: list[float],
    sequences: list[int],
) -> None:
    """Write `meta.json` (`reference`: `reference_stamp`'s) and move the cache into place,
    replacing any cache at `out`."""
    meta = {
        "version": CACHE_VERSION,
        "domains": domains,
        "seq_len": seq_len,
        **reference,
        "steps": steps,
        "global_batch_size": global_batch_size,
        "seed": seed,
        "sampling": sampling,
        "sequences": sequences,
    }
    atomic_write_text(staging / META_FILE, json.dumps(meta, indent=1))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def _check_fingerprint(meta_path: Path, meta: dict, checkpoint: Path) -> None:
    """The cache was scored with this reference's weights, wherever either lies now: a
    reference trained again to the same path would give wrong losses."""
    want = checkpoint_fingerprint(checkpoint)
    if meta.get("reference_fingerprint") != want:
        raise DoReMiError(
            f"{meta_path}: cache was scored with reference {meta.get('reference')} (fingerprint "
            f"{meta.get('reference_fingerprint')}), the run's reference {checkpoint} has fingerprint "
            f"{want} (run `doremi score` again)"
        )


def open_cache(
    cache_dir: Path,
    domains: list[str],
    seq_len: int,
    steps: int,
    global_batch_size: int,
    seed: int,
    sampling: list[float],
    reference: str | None = None,
) -> list[np.ndarray]:
    """Each domain's array, read-only, once the cache is checked to cover the run's data stream
    (and, when the run names its `reference`, to have been scored with it)."""
    meta_path = cache_dir / META_FILE
    if not meta_path.is_file():
        raise DoReMiError(f"{meta_path}: reference cache not found (run `doremi score` first)")
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != CACHE_VERSION:
        raise DoReMiError(
            f"{meta_path}: reference cache version {meta.get('version')}, this code reads "
            f"version {CACHE_VERSION} (run `doremi score` again)"
        )
    if meta.get("domains") != domains or meta.get("seq_len") != seq_len:
        raise DoReMiError(
            f"{meta_path}: cache was built for domains {meta.get('domains')} and seq_len "
            f"{meta.get('seq_len')}, the run has {domains} and {seq_len}"
        )
    for key, want in (("global_batch_size", global_batch_size), ("seed", seed)):
        if meta.get(key) != want:
            raise DoReMiError(
                f"{meta_path}: cache was scored for data.{key if key == 'seed' else 'train.' + key}"
                f"={meta.get(key)}, the run has {want} (another data stream)"
            )
    if not np.allclose(meta.get("sampling", []), sampling, rtol=0, atol=1e-12):
        raise DoReMiError(
            f"{meta_path}: cache was scored for proxy sampling weights {meta.get('sampling')}, "
            f"the run samples with {list(sampling)} (doremi.proxy_sampling)"
        )
    if meta.get("steps", 0) < steps:
        raise DoReMiError(
            f"{meta_path}: cache covers {meta.get('steps')} steps, fewer steps than the run's train.steps={steps}"
        )
    if reference is not None:
        _check_fingerprint(meta_path, meta, resolve_checkpoint(reference))
    return [np.load(_array_path(cache_dir, d), mmap_mode="r") for d in domains]
