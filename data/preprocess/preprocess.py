"""`doremi preprocess`: tokenize every domain into per-domain token stores (see data.store.store).

Steps: resolve and fingerprint the sources; stop if the stores already hold that fingerprint;
otherwise, in a staging directory inside the store directory, read each text domain, split its
documents into train/validation (data.preprocess.split), build the tokenizer (training a BPE on
the train documents), tokenize in `num_proc` processes (local files as resumable tasks per file,
data.preprocess.tasks; other sources as one ordered stream, data.preprocess.encode), generate the
synthetic domains, then move the files into place and write `manifest.json` last. Every input error is raised
before anything in the store directory changes; an interrupted commit leaves no manifest, so
the next run rebuilds (reusing the finished tasks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data.config import DataConfig, TokenizerConfig
from data.errors import DataError
from data.preprocess.encode import Encoder
from data.preprocess.split import validation_mask
from data.preprocess.tasks import (
    TASKS_PREFIX,
    Task,
    domain_tasks,
    finished,
    merge,
    remove_work_dirs,
    run_tasks,
    split_rows,
    task_key,
    work_dir,
)
from data.progress import Progress, datasets_bars
from data.sources.sources import (
    DomainPlan,
    SourceReader,
    TextSource,
    column_plans,
    digest,
    file_digest,
    needs_column_plans,
    plan_domains,
    shared_dataset_digest,
)
from data.sources.synthetic import check_fits, entropy, generate_documents, symbol_ids
from data.store.store import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    DomainEntry,
    Manifest,
    SplitWriter,
    TokenStores,
    open_stores,
    read_manifest,
    split_paths,
    token_dtype,
    write_manifest,
)
from data.tokenizer.bos import bos_token
from data.tokenizer.tokenizer import TOKENIZER_FILE, build_tokenizer, save_tokenizer

log = logging.getLogger(__name__)

READ_ROWS = 256
RESERVED_NAMES = {MANIFEST_FILE, TOKENIZER_FILE}


def tokenizer_fingerprint(cfg: TokenizerConfig) -> Any:
    if cfg.kind == "byte":
        return "byte"
    if cfg.kind == "bpe":
        return ["bpe", cfg.vocab_size, cfg.train_max_bytes, cfg.train_shares]
    path = Path(cfg.path or "").expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    content = file_digest(str(path)) if path.is_file() else cfg.path
    if path.is_file() and _defines_bos(path):  # the stores' bytes depend on add_bos (data.tokenizer.bos)
        return [cfg.kind, content, cfg.eos_token, {"add_bos": cfg.add_bos}]
    return [cfg.kind, content, cfg.eos_token]


def _defines_bos(path: Path) -> bool:
    try:
        return bos_token(path.read_text(encoding="utf-8")) is not None
    except (ValueError, OSError):
        return False  # not a tokenizer.json: build_tokenizer says so


def fingerprint_inputs(cfg: DataConfig, plans: list[DomainPlan]) -> dict[str, Any]:
    """Everything the stores' bytes depend on, by part: sources, tokenizer, split, dtype, format.
    The manifest records it, so that a rebuild from other inputs can say which part changed."""
    return {
        "version": FORMAT_VERSION,
        "domains": [[p.name, p.fingerprint] for p in plans],
        "column_domains": shared_dataset_digest(cfg) if needs_column_plans(cfg, plans) else None,
        "tokenizer": tokenizer_fingerprint(cfg.tokenizer),
        "split": [cfg.validation_fraction, cfg.split_seed],
        "token_dtype": cfg.token_dtype,
    }


def fingerprint(cfg: DataConfig, plans: list[DomainPlan]) -> str:
    return digest(fingerprint_inputs(cfg, plans))


class StoresInUseError(DataError):
    """`preprocess` into a store directory that holds stores built from other inputs: runs
    trained on them would be evaluated or resumed against the new ones."""


def changed_inputs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The parts of `fingerprint_inputs` that differ, named for a person: `tokenizer`,
    `domain 'web' source`, `domain 'x' added`, ..."""
    if not old:
        return ["unknown (the stores were built by an older version, which did not record their inputs)"]
    names = {"version": "format version", "column_domains": "the shared dataset of column domains"}
    parts = [names.get(k, k) for k in new if k != "domains" and old.get(k) != new[k]]
    before, after = dict(map(tuple, old.get("domains", []))), dict(map(tuple, new["domains"]))
    parts += [f"domain {d!r} removed" for d in before if d not in after]
    parts += [
        f"domain {d!r} added" if d not in before else f"domain {d!r} source" for d in after if before.get(d) != after[d]
    ]
    if not parts and list(before) != list(after):
        parts.append("order of the domains")
    return parts


class StoresMismatchError(DataError):
    """A stage given stores built from other inputs than its config's `data` section names."""


def _readable_inputs(cfg: DataConfig) -> dict[str, Any] | None:
    try:
        return fingerprint_inputs(cfg, plan_domains(cfg))
    except DataError:
        return None  # a source not readable here (the stores were copied without it)


def check_stores_match(cfg: DataConfig, manifest: Manifest) -> None:
    """The stores a stage reads were built from the inputs its config's `data` section names
    (docs/design.md section 6b): domains reordered after preprocessing would give a weights
    list to the wrong domains, a removed domain would still be trained on, a changed tokenizer
    or source would train on the old stores. Where a source cannot be read here, the domain
    names and order, tokenizer, split and dtype are compared. Stores of versions that did not
    record their inputs are not checked."""
    if not manifest.inputs:
        return
    inputs = _readable_inputs(cfg)
    if inputs is not None and digest(inputs) == manifest.fingerprint:
        return
    if inputs is None:
        names = [d.name for d in cfg.domains]
        inputs = {**manifest.inputs, "tokenizer": tokenizer_fingerprint(cfg.tokenizer)}
        inputs |= {"split": [cfg.validation_fraction, cfg.split_seed], "token_dtype": cfg.token_dtype}
        before = dict(map(tuple, manifest.inputs.get("domains", [])))
        inputs["domains"] = [[n, before.get(n, "?")] for n in names]
        if inputs == manifest.inputs:
            return
    changed = changed_inputs(manifest.inputs, inputs) or ["fingerprint"]
    raise StoresMismatchError(
        f"{cfg.store_dir}: stores built from other inputs than the config's data section (changed: "
        f"{', '.join(changed)}; stores {manifest.fingerprint[:12]}, config {digest(inputs)[:12]}); run "
        f"`doremi preprocess CONFIG` into another data.store_dir, or restore the data section they were built from"
    )


def preprocess(cfg: DataConfig, force: bool = False, progress: bool = True) -> Manifest:
    """Build the stores in `cfg.store_dir`; return the existing manifest when its fingerprint
    matches and the files are intact. Stores built from other inputs are never replaced
    without `force` (StoresInUseError): runs trained on them read them by path."""
    cfg.validate()
    plans = plan_domains(cfg)
    inputs = fingerprint_inputs(cfg, plans)
    fp = digest(inputs)
    store = Path(cfg.store_dir)
    if not force:
        current = _up_to_date(store, fp)
        if current is not None:
            log.info("%s: stores up to date (fingerprint %s)", store, fp[:12])
            return current
        _refuse_other_inputs(store, fp, inputs)
    _refuse_foreign(store)
    store.mkdir(parents=True, exist_ok=True)
    _remove_orphans(store)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=store))
    try:
        with contextlib.nullcontext() if progress else datasets_bars(False):
            manifest = _build(cfg, plans, fp, staging, progress)
        manifest.inputs = inputs
        _commit(store, staging, manifest)
        remove_work_dirs(store)
    except DataError:  # an input to change: its finished tasks will not be resumed
        remove_work_dirs(store)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def preprocess_share(cfg: DataConfig, index: int, count: int, progress: bool = True) -> tuple[int, int]:
    """Run share `index` of `count` of the build's tasks (tasks index, index + count, ...) and
    record them, for builds spread over nodes that see one store directory (a shared file
    system: experiments/launch/slurm/preprocess.sbatch). Every share reads the same inputs and
    builds the same tokenizer, hence the same work directory (data.preprocess.tasks); the stores and
    manifest are written by a later `preprocess`, which runs the tasks still missing and merges
    them (same bytes as one process: tests/test_data_tasks.py). Returns (tasks run here, tasks
    in the share); (0, 0) when the stores are already up to date."""
    if not 0 <= index < count:
        raise DataError(f"task share {index} of {count}: expected 0 <= index < count")
    cfg.validate()
    plans = plan_domains(cfg)
    inputs = fingerprint_inputs(cfg, plans)
    fp = digest(inputs)
    store = Path(cfg.store_dir)
    if _up_to_date(store, fp) is not None:
        return 0, 0
    _refuse_other_inputs(store, fp, inputs)
    _refuse_foreign(store)
    store.mkdir(parents=True, exist_ok=True)
    # Not a `.staging-PID-` directory in the store: another node would take it for an orphan.
    with tempfile.TemporaryDirectory(prefix="doremi-share-") as cache:
        prepared = _prepare(cfg, plans, fp, store, SourceReader(cfg, Path(cache)))
        share = prepared.all_tasks()[index::count]
        todo = [t for t in share if finished(t, prepared.work, prepared.dtype) is None]
        meter = Progress([p.name for p in prepared.plans]) if progress else None
        run_tasks(todo, prepared.masks(), prepared.tok, prepared.dtype, cfg.num_proc, prepared.work, meter)
    return len(todo), len(share)


_SPLIT_FILES = {f"{split}.{ext}" for split in ("train", "validation") for ext in ("bin", "idx")}
_OWN_NAMES = {TOKENIZER_FILE, ".lock", "stage.json", "stage.started.json"}
_OWN_PREFIXES = (".staging-", ".old-", ".datatrove-", TASKS_PREFIX)  # .datatrove-: data.preprocess.scale's logs


def _refuse_foreign(store: Path) -> None:
    """A store directory without a manifest (none yet, or a build cut short) may hold only what
    preprocessing and the pipeline put there: its domain folders would otherwise replace a
    folder of the same name that is not ours (docs/design.md section 6b)."""
    if not store.is_dir() or (store / MANIFEST_FILE).is_file():
        return
    for e in sorted(store.iterdir()):
        own = e.name in _OWN_NAMES or e.name.startswith(_OWN_PREFIXES) or e.name.endswith(".tmp")
        if not own and not (e.is_dir() and {f.name for f in e.iterdir()} <= _SPLIT_FILES):
            raise DataError(
                f"{store}: data.store_dir holds {e.name!r}, which is not part of token stores (no manifest.json); "
                f"choose an empty or new data.store_dir"
            )


def _remove_orphans(store: Path) -> None:
    """Staging directories left by killed runs (their process no longer exists on this host)."""
    for path in store.glob(".staging-*-*"):
        try:
            os.kill(int(path.name.split("-")[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def _up_to_date(store: Path, fp: str) -> Manifest | None:
    try:
        built = read_manifest(store)
        if built.fingerprint != fp:
            return None
        if built.artifact is None:  # built before per-file hashes: add them (sizes are checked)
            TokenStores(store, built).validate()
            write_manifest(store, built)
        return open_stores(store).manifest
    except DataError:
        return None


def _refuse_other_inputs(store: Path, fp: str, inputs: dict[str, Any]) -> None:
    try:
        built = read_manifest(store)
    except DataError:
        return  # no complete stores (none yet, or a build cut short): nothing to protect
    if built.fingerprint == fp:
        return  # the same inputs, damaged files: rebuilding gives the same bytes back
    raise StoresInUseError(
        f"{store}: holds stores built from other inputs (changed: {', '.join(changed_inputs(built.inputs, inputs))}; "
        f"fingerprint {built.fingerprint[:12]} -> {fp[:12]}); runs trained on them read them there: use "
        f"another data.store_dir, or `doremi preprocess CONFIG --force` to replace them"
    )


def _split_batches(source: TextSource, mask: np.ndarray, field: str) -> Iterator[tuple[list[str], list[str]]]:
    """(train texts, validation texts) per read batch (data.preprocess.tasks.split_rows)."""
    return split_rows(source.batches(READ_ROWS), mask, source.name, field)


def byte_budgets(names: list[str], total: int, shares: str | dict[str, float]) -> list[int]:
    """Bytes of each text domain's training split that the BPE trains on: `total` shared
    equally, or in proportion to a mapping domain -> share (unlisted domains: 0)."""
    raw = [1.0] * len(names) if shares == "equal" else [float(shares.get(n, 0.0)) for n in names]
    s = sum(raw)
    return [int(total * r / s) for r in raw]


def tokenizer_training_texts(
    sources: list[tuple[DomainPlan, TextSource, np.ndarray]], total: int, shares: str | dict[str, float]
) -> Iterator[str]:
    """Each text domain's training documents in order, until its byte budget is spent (the
    document that crosses it included)."""
    budgets = byte_budgets([p.name for p, _, _ in sources], total, shares)
    for (plan, source, mask), budget in zip(sources, budgets):
        seen = 0
        for train, _ in _split_batches(source, mask, plan.text_field):
            for text in train:
                if seen >= budget:
                    break
                yield text
                seen += len(text.encode("utf-8"))
            if seen >= budget:
                break


@dataclasses.dataclass
class Prepared:
    """A build's inputs read and its tokenizer built: what the tasks (data.preprocess.tasks) and the merge
    need, the same on every node that prepares the same config."""

    plans: list[DomainPlan]
    texts: list[tuple[DomainPlan, TextSource, np.ndarray]]
    tok: Any
    dtype: str
    work: Path
    tasks: dict[str, list[Task]]

    def all_tasks(self) -> list[Task]:
        return [t for ts in self.tasks.values() for t in ts]

    def masks(self) -> dict[str, np.ndarray]:
        return {p.name: mask for p, _, mask in self.texts}


def _prepare(cfg: DataConfig, plans: list[DomainPlan], fp: str, store: Path, reader: SourceReader) -> Prepared:
    if needs_column_plans(cfg, plans):
        plans = plans + column_plans(cfg, reader, plans)
    for p in plans:
        if p.name in RESERVED_NAMES:
            raise DataError(f"data.domains: domain name {p.name!r} is reserved for a store file")
    texts = []
    for p in plans:
        if p.kind != "synthetic":
            source = reader.open(p)
            if source.num_rows == 0:
                raise DataError(f"domain {p.name!r}: empty domain ({p.description} has no documents)")
            texts.append((p, source, validation_mask(source.num_rows, cfg.validation_fraction, cfg.split_seed, p.name)))
    if cfg.tokenizer.kind == "bpe" and not texts:
        raise DataError("data.tokenizer: kind 'bpe' is trained on the text domains, but there are none")
    tok = build_tokenizer(
        cfg.tokenizer,
        tokenizer_training_texts(texts, cfg.tokenizer.train_max_bytes, cfg.tokenizer.train_shares)
        if cfg.tokenizer.kind == "bpe"
        else None,
    )
    dtype = token_dtype(tok.vocab_size, cfg.token_dtype)
    for p in plans:
        if p.synthetic is not None:
            check_fits(p.synthetic, tok.vocab_size, tok.eos_id, f"domain {p.name!r}")

    work = work_dir(store, task_key([fp, tok.identity, dtype]))
    remove_work_dirs(store, keep=work)
    tasks = {p.name: domain_tasks(p.name, src.files, src.num_rows) for p, src, _ in texts if src.files is not None}
    return Prepared(plans, texts, tok, dtype, work, tasks)


def _build(cfg: DataConfig, plans: list[DomainPlan], fp: str, staging: Path, progress: bool) -> Manifest:
    from tqdm import tqdm

    prep = _prepare(cfg, plans, fp, staging.parent, SourceReader(cfg, staging / ".hf-cache"))
    plans, texts, tok, dtype, work, tasks = prep.plans, prep.texts, prep.tok, prep.dtype, prep.work, prep.tasks
    meter = Progress([p.name for p in plans]) if progress else None
    run_tasks(prep.all_tasks(), prep.masks(), tok, dtype, cfg.num_proc, work, meter)
    by_name = {p.name: (source, mask) for p, source, mask in texts}
    pooled = any(p.name not in tasks for p, _, _ in texts)
    with Encoder(tok, dtype, cfg.num_proc if pooled else 1) as encoder:
        entries = [
            _write_domain(p, by_name.get(p.name), tok, dtype, encoder, cfg, staging, tasks.get(p.name), work, meter)
            for p in tqdm(plans, desc="preprocess", unit="domain", disable=not progress)
        ]
    save_tokenizer(tok, staging / TOKENIZER_FILE)
    return Manifest(
        domains=entries,
        tokenizer=tok.identity,
        dtype=dtype,
        fingerprint=fp,
        sources={p.name: p.fingerprint for p in plans},
        split={"validation_fraction": cfg.validation_fraction, "seed": cfg.split_seed},
    )


def _counting_bytes(
    batches: Iterator[tuple[list[str], list[str]]], nbytes: list[int]
) -> Iterator[tuple[list[str], list[str]]]:
    """The batches unchanged, adding each split's UTF-8 bytes to `nbytes` (train, validation)."""
    for train, val in batches:
        nbytes[0] += sum(len(t.encode("utf-8")) for t in train)
        nbytes[1] += sum(len(t.encode("utf-8")) for t in val)
        yield train, val


def _write_domain(
    p: DomainPlan,
    text: tuple[TextSource, np.ndarray] | None,
    tok: Any,
    dtype: str,
    encoder: Encoder,
    cfg: DataConfig,
    staging: Path,
    tasks: list[Task] | None = None,
    work: Path | None = None,
    meter: Progress | None = None,
) -> DomainEntry:
    """The domain's stores in `staging`: merged from its finished tasks (local files), or
    tokenized here (other text sources), or generated (synthetic)."""
    writers = [SplitWriter(*split_paths(staging, p.name, split), dtype) for split in ("train", "validation")]
    nbytes = [0, 0]
    if tasks is not None:
        assert work is not None
        nbytes = merge(tasks, work, dtype, writers)
    elif p.synthetic is not None:
        docs = generate_documents(p.synthetic)
        mask = validation_mask(len(docs), cfg.validation_fraction, cfg.split_seed, p.name)
        for doc, is_val in zip(docs, mask):
            ids = np.append(symbol_ids(doc, tok.eos_id), tok.eos_id)
            writers[int(is_val)].append(ids, np.array([len(ids)]))
    else:
        assert text is not None
        source, mask = text
        read = 0
        for encoded in encoder.map(_counting_bytes(_split_batches(source, mask, p.text_field), nbytes)):
            for writer, (flat, lengths) in zip(writers, encoded):
                writer.append(flat, lengths)
            if meter is not None:
                meter.add(p.name, sum(len(flat) for flat, _ in encoded), sum(nbytes) - read)
                read = sum(nbytes)
    train, val = (w.close() for w in writers)
    if p.synthetic is None:
        train, val = (dataclasses.replace(c, bytes=n) for c, n in zip((train, val), nbytes))
    if train.documents + val.documents == 0:
        raise DataError(
            f"domain {p.name!r}: empty domain ({p.description} has only empty or whitespace-only documents)"
        )
    return DomainEntry(
        name=p.name,
        source=p.description,
        train=train,
        validation=val,
        entropy=entropy(p.synthetic) if p.synthetic else None,
        synthetic=dict(vars(p.synthetic), eos_id=tok.eos_id) if p.synthetic else None,
    )


def _commit(store: Path, staging: Path, manifest: Manifest) -> None:
    """Move the staged files into place; the manifest goes first out and last in."""
    (store / MANIFEST_FILE).unlink(missing_ok=True)
    for d in manifest.domains:
        target = store / d.name
        if target.exists():
            trash = store / f".old-{uuid.uuid4().hex}"
            os.replace(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(staging / d.name, target)
    os.replace(staging / TOKENIZER_FILE, store / TOKENIZER_FILE)
    write_manifest(store, manifest)
