"""`pairing.json`: what a run started from, measured, so that two arms can be shown to be paired.

A paired study (docs/design.md section 4e) compares two runs that must share their
initialisation and their per-domain data streams and differ only in the mixture. Sharing
`train.seed` and `data.seed` is the intent; this file records the realised quantities, written
by global rank 0 after a fresh run's first step:

- `init`: an XXH3-64 digest of every parameter's initial values, per (pipeline, tensor) rank
  position in global-rank order (two arms of one study run the same layout, so their lists
  compare entry by entry);
- `first_batch`: per domain, the sequence indices of the first step's global batch, in the
  order the domain's stream hands them out (`data.sampling.sampler.DomainBatchSampler.stream`).

Two arms with different mixtures draw different counts per domain, but from the same per-domain
streams, so for every domain one arm's list is a prefix of the other's (`check_paired`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from data.atomic import atomic_write_text

PAIRING_FILE = "pairing.json"


def parameter_digest(model: torch.nn.Module) -> str:
    """XXH3-64 over the names, shapes, dtypes and bytes of `model`'s parameters, in name order."""
    h = xxhash.xxh3_64()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_digests(model: torch.nn.Module) -> list[str]:
    """This rank's `parameter_digest`, gathered over the world in global-rank order (collective
    when a process group is up)."""
    mine = parameter_digest(model)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [str(d) for d in out]


def first_batch_by_domain(batch: list[tuple[int, int]], domains: list[str]) -> dict[str, list[int]]:
    """The (domain, sequence index) items of a global batch as the index list of each domain."""
    out: dict[str, list[int]] = {d: [] for d in domains}
    for d, index in batch:
        out[domains[d]].append(int(index))
    return out


def write_pairing(
    run_dir: Path, init: list[str], first_batch: dict[str, list[int]], train_seed: int, data_seed: int
) -> None:
    record = {"train_seed": train_seed, "data_seed": data_seed, "init": init, "first_batch": first_batch}
    atomic_write_text(Path(run_dir) / PAIRING_FILE, json.dumps(record, indent=1))


def read_pairing(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / PAIRING_FILE).read_text())


def check_paired(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What keeps two runs' pairing records from being a pair (empty: paired): another
    initialisation, or a domain whose first-step sequences are not a common stream's prefixes."""
    problems = []
    if a["init"] != b["init"]:
        problems.append("initial parameters differ")
    if sorted(a["first_batch"]) != sorted(b["first_batch"]):
        problems.append("domains differ")
        return problems
    for domain, xs in a["first_batch"].items():
        ys = b["first_batch"][domain]
        n = min(len(xs), len(ys))
        if xs[:n] != ys[:n]:
            problems.append(f"domain {domain}: first-step sequences {xs[:n]} vs {ys[:n]}")
    return problems
