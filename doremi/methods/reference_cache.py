"""The reference cache that `doremi score` writes and a proxy with `mixing.doremi.reference_cache`
reads: its layout, its `meta.json` fields and their checks live here only.

Per domain, `<domain>.npy` holds a float32 array [num_train_sequences, seq_len] of per-token
reference losses (NaN where not scored) indexed by the sequence's position in the domain's packed
train stream, so it is independent of the layout, the batch size and the step. `meta.json` holds
`version`, the proxy data stream the cache covers (`domains`, `seq_len`, `steps`,
`global_batch_size`, `seed`, `sampling`), the reference it was scored with (`reference`, and
`reference_fingerprint`: a reference trained again to the same path does not pass for the one
scored) and `sequences` (per domain, how many were scored). The cache is built in `<dir>.tmp` and
renamed into place, so that a `doremi score` cut short leaves nothing that looks like a cache.

`meta.json` carries the cache's artifact header (`data.artifact`; docs/design.md section 6b):
`running` in the staging directory, `finished` once published, the reference checkpoint as its
source and each array's size and hash (checked once per process when a proxy opens it). `doremi
score` replaces a directory only if its header says it is a reference cache (`check_out`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data import artifact
from doremi.errors import DoReMiError
from trainer.checkpoint.checkpoint import META, checkpoint_fingerprint, resolve_checkpoint

CACHE_VERSION = 2
META_FILE = "meta.json"


def _array_path(cache_dir: Path, domain: str) -> Path:
    return cache_dir / f"{domain}.npy"


def staging_dir(out: Path) -> Path:
    """Where `doremi score` builds the cache that `publish` then moves to `out`."""
    return out.with_name(out.name + ".tmp")


def check_out(out: Path) -> None:
    """Refuse, before any scoring, an `out` or staging directory that is not a reference cache
    (a run, a folder of files, the reference itself): `doremi score` replaces only its own."""
    for path in (out, staging_dir(out)):
        artifact.check_replaceable(path, "reference_cache", "doremi score")


def create_arrays(staging: Path, domains: list[str], num_sequences: list[int], seq_len: int) -> None:
    """One all-NaN array per domain (nothing scored yet), in a staging directory whose header
    says `running` (a leftover of a killed score is then known as ours)."""
    if staging.exists():
        artifact.remove_own(staging, "reference_cache", "doremi score")
    staging.mkdir(parents=True)
    artifact.write(staging / META_FILE, artifact.Header("reference_cache", status="running"))
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
    replacing a cache at `out` (nothing else: `check_out`)."""
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
    header = artifact.Header(
        "reference_cache",
        fingerprint=artifact.content_hash(meta),
        steps=steps,
        sources=[artifact.Source("checkpoint", reference["reference"], reference["reference_fingerprint"])],
        files=artifact.hash_files(staging, [_array_path(staging, d).name for d in domains]),
    )
    artifact.write(staging / META_FILE, header, meta)
    artifact.replace_dir(staging, out, "reference_cache", "doremi score")


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
    synthetic: bool = False,
) -> list[np.ndarray]:
    """Each domain's array, read-only, once the cache is checked to cover the run's data stream
    (and, when the run names its `reference`, to have been scored with it). `synthetic`: a cache
    of made-up losses that no checkpoint scored (the step bench's), whose reference is therefore
    not checked; no config reaches it."""
    meta_path = cache_dir / META_FILE
    if not meta_path.is_file():
        raise DoReMiError(f"{meta_path}: reference cache not found (run `doremi score` first)")
    meta = artifact.load_metadata(meta_path)
    if not isinstance(meta, dict):
        raise DoReMiError(f"{meta_path}: not a reference cache's metadata (expected a JSON object)")
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
            f"the run samples with {list(sampling)} (the method's proxy_sampling)"
        )
    if meta.get("steps", 0) < steps:
        raise DoReMiError(
            f"{meta_path}: cache covers {meta.get('steps')} steps, fewer steps than the run's train.steps={steps}"
        )
    if reference is not None:
        _check_fingerprint(meta_path, meta, resolve_checkpoint(reference))
    elif not synthetic:
        _check_recorded_reference(meta_path, meta)
    header = artifact.read(cache_dir)
    if header is not None:
        artifact.verify_files(cache_dir, header.files, "reference cache", once=True)
    return [np.load(_array_path(cache_dir, d), mmap_mode="r") for d in domains]


def _check_recorded_reference(meta_path: Path, meta: dict) -> None:
    """Without the method's `reference`, the reference the cache records must still be there with
    the weights it was scored with: a cache of a reference since trained again is stale, and
    one whose reference is gone cannot be verified."""
    recorded = Path(str(meta.get("reference")))
    if not (recorded / META).is_file():
        raise DoReMiError(
            f"{meta_path}: cannot verify the cache: its reference {recorded} is gone; set the method's reference "
            f"to the reference it was scored with, or run `doremi score` again"
        )
    _check_fingerprint(meta_path, meta, recorded)
