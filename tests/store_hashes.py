"""The fingerprint the golden-store tests compare: XXH3-64 of every file of a token store, and of
the manifest's content that does not depend on the bytes of binary or compressed inputs (their
sources' digests change with the compressor's version; the tokens must not)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import xxhash

from data.store.store import MANIFEST_FILE


def store_hashes(store_dir: str, plain_sources: Collection[str] = ()) -> dict[str, str]:
    """Path -> hash of each store file, and MANIFEST_FILE -> the hash of its stable keys, with
    the `sources` entries of the domains named in `plain_sources` (plain-text inputs)."""
    root = Path(store_dir)
    out = {
        str(p.relative_to(root)): xxhash.xxh3_64_hexdigest(p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(".")
    }
    raw = json.loads((root / MANIFEST_FILE).read_text())
    kept = {k: raw[k] for k in ("domains", "tokenizer", "dtype", "split", "version")}
    if plain_sources:
        kept["plain_sources"] = {k: v for k, v in raw["sources"].items() if k in plain_sources}
    out[MANIFEST_FILE] = xxhash.xxh3_64_hexdigest(json.dumps(kept, sort_keys=True).encode())
    return out
