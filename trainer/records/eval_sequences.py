"""Per-sequence validation losses of a run's evaluation, in a small file of its run directory
(`train.eval_sequence_losses`; docs/design.md 3b).

A per-domain standard error that treats sequences as independent understates the noise when
one document spans several sequences; these files let a study cluster them by document. One
row per evaluated sequence, domains one after another in domain order, sequences in order:

    domain      int32    index into `domains`
    sequence    int32    index of the sequence among its domain's evaluated ones
    loss_sum    float64  sum of its label tokens' losses (each sequence added in fp32)
    tokens      int32    its label tokens
    doc_first   int64    validation document id (store order) of its first label token
    doc_last    int64    validation document id of its last label token
    domains     str      the domain names;  split: `all`, `dev` or `test`;  step: int

math.fsum(loss_sum[domain == d]) / tokens[domain == d].sum() is the run's logged val_loss of
domain d, to the last bit (trainer.run.evaluate.sequence_means).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from data.atomic import atomic_write_bytes

DIR = "eval_sequences"


def sequence_file(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIR / f"step_{step:07d}.npz"


def write_sequence_losses(
    run_dir: str | Path,
    step: int,
    domains: list[str],
    split: str,
    per_sequence: list[tuple[np.ndarray, np.ndarray]],
    documents: list[tuple[np.ndarray, np.ndarray]],
) -> Path:
    """Write one evaluation's rows (`trainer.run.evaluate.evaluate_sequences`, and the feed's
    `validation_documents` for the same sequences) atomically; returns the file."""
    for name, (loss, _), (first, _) in zip(domains, per_sequence, documents):
        if len(loss) != len(first):
            raise ValueError(f"domain {name!r}: {len(loss)} sequence losses but {len(first)} document rows")
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        domain=np.concatenate([np.full(len(loss), d, np.int32) for d, (loss, _) in enumerate(per_sequence)]),
        sequence=np.concatenate([np.arange(len(loss), dtype=np.int32) for loss, _ in per_sequence]),
        loss_sum=np.concatenate([loss for loss, _ in per_sequence]).astype(np.float64),
        tokens=np.concatenate([tokens for _, tokens in per_sequence]).astype(np.int32),
        doc_first=np.concatenate([first for first, _ in documents]).astype(np.int64),
        doc_last=np.concatenate([last for _, last in documents]).astype(np.int64),
        domains=np.array(domains),
        split=np.array(split),
        step=np.array(step, dtype=np.int64),
    )
    path = sequence_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path


def read_sequence_losses(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}
