"""Sharded, atomic checkpoints that load into another (tp, pp, dp) layout.

Layout of `RUN/checkpoints/step_0000042/`:
- `model_pp{p}_tp{t}.pt`: {name: tensor}, the tp-local parameters of stage p, written once per
  (tp, pp) position (by dp rank 0). The tied embedding's duplicate on the last stage
  (`trainer.parallel.tied.is_tied_duplicate`) is skipped; loading fills it by name.
- `optim_pp{p}_tp{t}_dp{d}.pt`: {"kind", "state": {name: {key: tensor}}}, written by each rank
  that holds optimizer state of its own: every owner under ZeRO-1, dp rank 0 otherwise.
- `rng_rank{r}.pt`: each rank's torch (CPU and CUDA), numpy and python RNG states.
- `extra.pt`: the caller's state (JSON-able values and tensors), from rank 0.
- `meta.json`: format version, step, layout, optimizer kind, the model config (`model`, when
  the model carries one), the stores' identity (`data`: fingerprint and tokenizer, when the
  caller gives it; `check_data` compares it on every load), per parameter its full shape, ShardSpec, dtype and file per saved tp
  rank, per parameter the optimizer file per tp rank, and every file's size and XXH3-64 hash.

Integrity: each file's XXH3-64 hash (xxhash; about 10x the speed of zlib's CRC-32, which cost a
quarter of the load time: experiments/notes/CHECKPOINTS.md) is computed over its bytes as they are
written (torch's own per-record zip CRC, which a memory-mapped load never checks, is turned off
for these writes) and checked when a rank first reads the file. Loading checks
the model config's architecture keys (`trainer.checkpoint.architecture`) and the parameter set both ways (names the
model lacks, names the checkpoint lacks) before any tensor is copied, so a checkpoint of
another model never loads into the parameters they happen to share.

Atomicity: every rank writes into `step_XXXXXXX.tmp/`; after all have written, rank 0 writes
`meta.json` and renames the directory. Only directories with `meta.json` and no `.tmp` suffix
are checkpoints. What killed writes of this code leave (`.tmp` directories) is removed by
`remove_leftovers`, at every save and at every resume (a load with optimizer state); a step
directory without `meta.json` was not written by it (an interrupted copy of a run) and is moved
aside to `step_NNNNNNN.incomplete-<time>`, never deleted (docs/design.md section 6b). All ranks
must see one filesystem (shared storage across nodes).

`meta.json` carries the checkpoint's artifact header (`data.artifact`: kind `checkpoint`,
finished at its step, the stores as its source; its files are `files`).

Resharding: every tensor is looked up by parameter name, and cut and joined by the `ShardSpec`
and expert-parallel tag its row of the sharding plan (`trainer.model.sharding`) put on the
parameter: this module holds no list of names. When the saved tp equals the current tp a rank
reads its own shard; otherwise it reads every saved tp shard, `unshard`s and `shard`s
for its new tp rank. Optimizer state tensors shaped like the tp-local parameter get the same
treatment (the bf16 optimizer's fp32 "master" among them); a state dimension of size 1 where
the parameter is sharded (Adafactor's factored row or column statistic) is averaged over the
old shards (exact for the mean it stores) and replicated to the new ones; scalars (the step
count) come from tp rank 0. The dp layout and the ZeRO-1 partition may change freely (state is
per whole parameter). RNG states are restored only when the layout is unchanged.

Parameter precision may change on resume too (`meta.json` "master_weights" says whether the
state holds fp32 masters). Resuming fp32 parameters from a bf16 run loads each parameter from
its master, not from its bf16 rounding; a bf16 run resuming from an fp32 one takes each master
from the saved fp32 parameter. Loading without an optimizer (a frozen reference, eval) reads
the parameters as saved: the weights the model computed with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from data import artifact
from data.artifact import HASH_KEY, file_hash
from data.atomic import atomic_path, atomic_write_text
from data.errors import UserError
from trainer.checkpoint.architecture import architecture_diff
from trainer.optim.interface import Optimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.expert import ep_full_shape, ep_gather, ep_gather_state, ep_slice, ep_slice_state
from trainer.parallel.shard import ShardSpec, full_shape, get_shard_spec, shard, unshard
from trainer.parallel.tied import is_tied_duplicate

FORMAT_VERSION = 2
META = "meta.json"
_STEP_DIR = re.compile(r"step_(\d{7,})")
_OLD = ".old.tmp"


class CheckpointError(UserError, ValueError):
    """A missing, incompatible or damaged checkpoint: one line naming the file or parameter."""


# -- locating ---------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name) and (d / META).is_file()]
    return sorted(found, key=lambda d: int(_STEP_DIR.fullmatch(d.name).group(1)))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run directory (partial `.tmp` ones are ignored)."""
    found = _complete(Path(run_dir) / "checkpoints")
    return found[-1] if found else None


def incomplete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Step directories without `meta.json` (`step_NNNNNNN`, not `.tmp`): not written by this
    code, whose own writes are `.tmp` until complete; an interrupted copy of a run, say."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [
        d for d in sorted(root.iterdir()) if d.is_dir() and _STEP_DIR.fullmatch(d.name) and not (d / META).is_file()
    ]


def set_aside_incomplete(run_dir: str | os.PathLike, say: bool = True) -> list[Path]:
    """Move each of `incomplete_checkpoints` to `step_NNNNNNN.incomplete-<time>`, one line on
    stderr each; returns where they went. Never deleted: the tool removes only what it made."""
    import sys

    moved = []
    for d in incomplete_checkpoints(run_dir):
        dest = artifact.set_aside(d)
        moved.append(dest)
        if say:
            print(f"{d}: checkpoint without {META} (incomplete copy?), moved aside to {dest}", file=sys.stderr)
    return moved


def set_aside_found(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints set aside earlier (`step_NNNNNNN.incomplete-*`)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(root.glob("step_*.incomplete-*")) if root.is_dir() else []


def remove_leftovers(run_dir: str | os.PathLike) -> list[Path]:
    """Remove what this code's killed writes left under `RUN/checkpoints` (`.tmp` directories)
    and set step directories without `meta.json` aside (`set_aside_incomplete`). Never a
    complete checkpoint: an overwrite killed between its two renames gets its previous
    checkpoint back. Returns what was removed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    for old in root.glob(f"step_*{_OLD}"):
        final = old.with_name(old.name.removesuffix(_OLD))
        if not final.exists() and (old / META).is_file():
            old.rename(final)
    set_aside_incomplete(run_dir)
    removed = [
        d for d in sorted(root.iterdir()) if d.is_dir() and d.name.startswith("step_") and d.name.endswith(".tmp")
    ]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def resolve_checkpoint(path_or_run_dir: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory's latest complete checkpoint. Another artifact
    with a `meta.json` (a reference cache) is named by its kind (docs/design.md section 6b), not
    read as a checkpoint and refused for a missing config or model section."""
    p = Path(path_or_run_dir)
    if (p / META).is_file():
        try:
            header = artifact.read(p)
        except artifact.ArtifactError:  # a damaged meta.json: the loader names it as a checkpoint's
            return p
        if header is not None and header.kind != "checkpoint":
            raise CheckpointError(
                f"{p}: holds a {header.kind.replace('_', ' ')}, expected a checkpoint directory or a run directory"
            )
        return p
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"{p}: run directory has no complete checkpoint")
        return latest
    raise CheckpointError(f"{p}: no checkpoint found (expected a checkpoint directory with {META} or a run directory)")


# -- saving -----------------------------------------------------------------------------------


def _check_extra(value: Any, path: str = "extra") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{path}: checkpoint keys must be str or int, got {type(k).__name__}")
            _check_extra(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_extra(v, f"{path}[{i}]")
    elif not (value is None or isinstance(value, (str, int, float, bool, torch.Tensor))):
        raise TypeError(
            f"{path}: checkpoint extra state must be JSON-able values or tensors, got {type(value).__name__}"
        )


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`torch.save` writes a view's whole storage; copy views so each file holds only its tensors."""
    t = t.detach()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class _ChecksumWriter:
    """A binary file that keeps the XXH3-64 hash and length of the bytes written through it."""

    def __init__(self, f: Any, path: Path):
        self.f, self.path, self.hash, self.size = f, path, xxhash.xxh3_64(), 0

    def write(self, data: Any) -> int:
        self.hash.update(data)
        self.size += memoryview(data).nbytes
        try:
            return self.f.write(data)
        except OSError as e:  # a full disk: name the file (the CLI prints one line)
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def flush(self) -> None:
        self.f.flush()


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """torch.save computes a CRC-32 per zip record, which a memory-mapped torch.load never
    checks; ours covers the whole file instead."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _save(path: Path, obj: Any) -> dict[str, Any]:
    """Write `obj` atomically; returns the file's size and XXH3-64 hash as written."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f, _without_zip_crc():
            out = _ChecksumWriter(f, path)
            torch.save(obj, out)
    return {"bytes": out.size, HASH_KEY: out.hash.hexdigest()}


def _rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(py_state), py_gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _spec_json(spec: ShardSpec | None) -> dict[str, Any] | None:
    return None if spec is None else {"dim": spec.dim, "parts": list(spec.parts)}


def _spec_from_json(js: dict[str, Any] | None) -> ShardSpec | None:
    return None if js is None else ShardSpec(js["dim"], tuple(js["parts"]))


def _gather_to_main(entry: dict[str, Any], pc: ParallelContext) -> list[dict[str, Any]]:
    if pc.world_size == 1:
        return [entry]
    out: list[Any] | None = [None] * pc.world_size if pc.is_main else None
    dist.gather_object(entry, out, dst=0)
    return out or []


def _write_rank_files(
    tmp: Path, model: torch.nn.Module, optimizer: Optimizer | None, pc: ParallelContext, extra: dict[str, Any]
) -> dict[str, Any]:
    pp, tp, dp = pc.pp_rank, pc.tp_rank, pc.dp_rank
    entry: dict[str, Any] = {"pp": pp, "tp": tp, "params": {}, "optim": None, "files": {}}
    files = entry["files"]
    # Expert-parallel weights are written whole (all experts), so the files do not depend on ep.
    named = [(n, p) for n, p in model.named_parameters() if not is_tied_duplicate(n, pc)]
    values = {n: ep_gather(p.detach(), p) for n, p in named}
    if dp == 0:
        file = f"model_pp{pp}_tp{tp}.pt"
        files[file] = _save(tmp / file, {n: _own_storage(values[n]) for n, _ in named})
        entry["params"] = {
            n: {
                "shape": list(ep_full_shape(p, full_shape(p))),
                "spec": _spec_json(get_shard_spec(p)),
                "dtype": str(p.dtype).removeprefix("torch."),
                "stage": pp,
                "file": file,
            }
            for n, p in named
        }
    sd = optimizer.state_dict() if optimizer is not None else {}
    if optimizer is not None:
        sd = {**sd, "state": ep_gather_state(sd["state"], dict(model.named_parameters()))}
    if optimizer is not None and (optimizer.zero1 or dp == 0):
        file = f"optim_pp{pp}_tp{tp}_dp{dp}.pt"
        state = {
            n: {k: _own_storage(v) for k, v in s.items()}
            for n, s in sd["state"].items()
            if not is_tied_duplicate(n, pc)
        }
        files[file] = _save(tmp / file, {"kind": sd["kind"], "state": state})
        entry["optim"] = {
            "file": file,
            "kind": sd["kind"],
            "names": sorted(state),
            "master": any("master" in s for s in state.values()),
        }
    files[f"rng_rank{pc.rank}.pt"] = _save(tmp / f"rng_rank{pc.rank}.pt", _rng_state(pc.device))
    if pc.is_main:
        files["extra.pt"] = _save(tmp / "extra.pt", extra)
    return entry


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's config (`model.cfg`, a dataclass) as JSON values; None for a model without."""
    cfg = getattr(model, "cfg", None)
    if not dataclasses.is_dataclass(cfg):
        return None
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _metadata(
    step: int,
    entries: list[dict[str, Any]],
    pc: ParallelContext,
    zero1: bool,
    model_cfg: dict[str, Any] | None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for e in entries:
        for name, info in e["params"].items():
            cur = params.setdefault(
                name, {k: info[k] for k in ("shape", "spec", "dtype", "stage")} | {"files": [None] * pc.tp}
            )
            cur["files"][e["tp"]] = info["file"]
    optim_files: dict[str, list[str | None]] = {}
    kinds = {e["optim"]["kind"] for e in entries if e["optim"]}
    for e in entries:
        if e["optim"]:
            for name in e["optim"]["names"]:
                optim_files.setdefault(name, [None] * pc.tp)[e["tp"]] = e["optim"]["file"]
    files = dict(sorted((name, f) for e in entries for name, f in e["files"].items()))
    header = artifact.Header(
        "checkpoint",
        step=step,
        fingerprint=_fingerprint_of(step, files),
        sources=[artifact.Source("stores", "", data.get("fingerprint"))] if data else [],
    )
    return {
        artifact.HEADER_KEY: header.to_json(),
        "format": FORMAT_VERSION,
        "step": step,
        "layout": {"tp": pc.tp, "pp": pc.pp, "dp": pc.dp},
        "zero1": zero1,
        "optimizer": kinds.pop() if kinds else None,
        "master_weights": any(e["optim"]["master"] for e in entries if e["optim"]),
        "model": model_cfg,
        "data": data,
        "params": dict(sorted(params.items())),
        "optim_files": dict(sorted(optim_files.items())),
        "files": files,
    }


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints; each is renamed out of view first, so a
    kill halfway leaves a `.tmp` leftover, not a checkpoint with files missing."""
    if keep > 0:
        for old in _complete(root)[:-keep]:
            gone = old.with_name(old.name + ".pruned.tmp")
            old.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    pc: ParallelContext,
    extra: dict[str, Any],
    keep: int = 0,
    data: dict[str, Any] | None = None,
) -> Path:
    """Write this step's checkpoint from every rank (collective); keep the newest `keep`
    (0: all). `data`: the identity of the stores it was trained on (`data.store.store.Manifest.identity`),
    which `load_checkpoint` compares. Returns the checkpoint directory."""
    _check_extra(extra)
    final = checkpoint_dir(run_dir, step)
    root, tmp = final.parent, final.with_name(final.name + ".tmp")
    if pc.is_main:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(run_dir)
        tmp.mkdir()
    pc.barrier()
    entry = _write_rank_files(tmp, model, optimizer, pc, extra)
    entries = _gather_to_main(entry, pc)
    if pc.is_main:
        zero1 = bool(optimizer is not None and optimizer.zero1)
        meta = _metadata(step, entries, pc, zero1, model_config(model), data)
        atomic_write_text(tmp / META, json.dumps(meta, indent=1))
        if final.exists():
            old = final.with_name(final.name + _OLD)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _prune(root, keep)
    pc.barrier()
    return final


# -- loading ----------------------------------------------------------------------------------


class _Reader:
    """Opens each checkpoint file at most once (memory-mapped), after checking its size and
    its hash: a corrupted file is refused before any of its tensors is used. Only the files
    this rank reads are checked. (Hashing on a worker thread during the load was slower: the
    two passes compete for memory bandwidth; experiments/notes/CHECKPOINTS.md.)"""

    def __init__(self, ck: Path, meta: dict[str, Any]):
        self.ck, self.files, self.cache = ck, meta["files"], {}

    def _check_size(self, name: str) -> None:
        path, want = self.ck / name, self.files.get(name)
        if not path.is_file():
            raise CheckpointError(f"{path}: checkpoint file missing")
        if want is None:
            raise CheckpointError(f"{path}: not listed in {META} (its checksum unknown)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{path}: truncated or corrupted checkpoint file (expected {want['bytes']} bytes, found {size})"
            )

    def _check_hash(self, name: str) -> None:
        got, want = file_hash(self.ck / name), self.files[name][HASH_KEY]
        if got != want:
            raise CheckpointError(f"{self.ck / name}: corrupted checkpoint file (XXH3-64 {got}, {META} records {want})")

    def __call__(self, name: str) -> Any:
        if name not in self.cache:
            path = self.ck / name
            self._check_size(name)
            self._check_hash(name)
            try:
                self.cache[name] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(
                    f"{path}: corrupted checkpoint file ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})"
                ) from None
        return self.cache[name]


def _read_meta(ck: Path) -> dict[str, Any]:
    try:
        meta = json.loads((ck / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ck / META}: unreadable checkpoint metadata ({e})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{ck / META}: checkpoint format {meta.get('format')!r}, this code reads format {FORMAT_VERSION}"
        )
    return meta


def _is_full(saved: ShardSpec | None, saved_tp: int) -> bool:
    """The saved tensor is the whole parameter (replicated over tp, or saved at tp 1)."""
    return saved is None or saved_tp == 1


def _moves(saved: ShardSpec | None, spec: ShardSpec | None, saved_tp: int, pc: ParallelContext) -> bool:
    """Whether this rank's tensor must be rebuilt from other tp ranks' shards; if not, it reads
    its own (saved_tp == tp, same sharding) or the only one (replicated or saved at tp 1)."""
    return not (_is_full(saved, saved_tp) or (saved_tp == pc.tp and saved == spec))


def _own_source(saved: ShardSpec | None, saved_tp: int, pc: ParallelContext) -> int:
    return 0 if _is_full(saved, saved_tp) else pc.tp_rank


def _unshard_state(shards: list[torch.Tensor], saved: ShardSpec, saved_local: int) -> torch.Tensor:
    """A state tensor of the full parameter from its saved tp shards. `saved_local`: the saved
    tp-local parameter's size along the shard dimension."""
    t = shards[0]
    if t.ndim == 0:
        return t
    if t.shape[saved.dim] == saved_local:
        return unshard(shards, saved)
    if t.shape[saved.dim] == 1:
        return torch.stack(shards).mean(dim=0)
    raise CheckpointError(
        f"optimizer state of shape {tuple(t.shape)} does not follow its parameter's sharding along dim {saved.dim}"
    )


def _shard_state(full: torch.Tensor, spec: ShardSpec | None, shape: list[int], pc: ParallelContext) -> torch.Tensor:
    """This tp rank's slice of a full-parameter state tensor; one reduced (size 1) along the
    shard dimension is replicated."""
    if spec is None or full.ndim == 0 or full.shape[spec.dim] != shape[spec.dim]:
        return full
    return shard(full, spec, pc.tp_rank, pc.tp)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _check_model_config(ck: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse a checkpoint of another architecture, even one whose tensors have the same shapes
    (head counts, a vocabulary within the same padding)."""
    if saved is None or current is None:
        return
    diff = [
        f"model.{k} is {_show(was)} in the checkpoint but {_show(now)} now"
        for k, was, now in architecture_diff(saved, current)
    ]
    if diff:
        raise CheckpointError(f"checkpoint {ck}: {'; '.join(diff)}")


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _model_names(params: dict[str, torch.Tensor], pc: ParallelContext) -> set[str]:
    """The names of the whole model's parameters, over every pipeline stage (collective)."""
    names = sorted(params)
    if pc.world_size == 1:
        return set(names)
    out: list[Any] = [None] * pc.world_size
    dist.all_gather_object(out, names)
    return {n for rank_names in out for n in rank_names}


def _check_param_set(ck: Path, saved: dict[str, Any], params: dict[str, torch.Tensor], pc: ParallelContext) -> None:
    """The checkpoint holds exactly the model's parameters: none missing, and none that the
    model lacks (extra layers, an untied head) silently left behind."""
    names = _model_names(params, pc)
    missing, unexpected = sorted(names - set(saved)), sorted(set(saved) - names)
    if missing:
        raise CheckpointError(
            f"checkpoint {ck}: has no parameter {_names(missing)} of the model (a checkpoint of another model?)"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint {ck}: holds parameter {_names(unexpected)} that the model lacks "
            f"(a checkpoint of another model?)"
        )


def _check_param(name: str, param: torch.Tensor, info: dict[str, Any], ck: Path, pc: ParallelContext) -> None:
    want = list(ep_full_shape(param, full_shape(param)))
    if list(info["shape"]) != want:
        raise CheckpointError(
            f"{ck}: parameter {name!r} has shape {tuple(info['shape'])} in the checkpoint, "
            f"the model expects {tuple(want)}"
        )


def _load_param(
    name: str, param: torch.Tensor, info: dict[str, Any], saved_tp: int, read: _Reader, pc: ParallelContext
) -> torch.Tensor:
    saved, spec = _spec_from_json(info["spec"]), get_shard_spec(param)
    if not _moves(saved, spec, saved_tp, pc):
        own = read(info["files"][_own_source(saved, saved_tp, pc)])[name]
        return ep_slice(shard(own, spec, pc.tp_rank, pc.tp) if _is_full(saved, saved_tp) else own, param)
    full = unshard([read(f)[name] for f in info["files"]], saved)
    return ep_slice(shard(full, spec, pc.tp_rank, pc.tp), param)


def _load_state(
    name: str,
    spec: ShardSpec | None,
    meta: dict[str, Any],
    read: _Reader,
    ck: Path,
    pc: ParallelContext,
    keys: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """The optimizer state of parameter `name` (only `keys`, if given) for this rank's tp slice."""
    files = meta["optim_files"].get(name)
    if files is None:
        raise CheckpointError(f"{ck}: checkpoint has no optimizer state for parameter {name!r}")
    info, saved_tp = meta["params"][name], meta["layout"]["tp"]
    saved = _spec_from_json(info["spec"])
    if not _moves(saved, spec, saved_tp, pc):
        own = read(files[_own_source(saved, saved_tp, pc)])["state"][name]
        return {
            k: _shard_state(v, spec, info["shape"], pc) if _is_full(saved, saved_tp) else v
            for k, v in own.items()
            if keys is None or k in keys
        }
    per_tp = [read(f)["state"][name] for f in files]
    saved_local = info["shape"][saved.dim] // saved_tp
    return {
        k: _shard_state(_unshard_state([s[k] for s in per_tp], saved, saved_local), spec, info["shape"], pc)
        for k in per_tp[0]
        if keys is None or k in keys
    }


def _load_optimizer(
    optimizer: Optimizer,
    params: dict[str, torch.Tensor],
    meta: dict[str, Any],
    read: _Reader,
    ck: Path,
    pc: ParallelContext,
) -> None:
    if meta["optimizer"] is None:
        raise CheckpointError(f"{ck}: checkpoint has no optimizer state")
    if meta["optimizer"] != optimizer.kind:
        raise CheckpointError(f"{ck}: optimizer state is {meta['optimizer']!r}, the run uses {optimizer.kind!r}")
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name in optimizer.owned_names():
        param = params[name]
        state[name] = ep_slice_state(_load_state(name, get_shard_spec(param), meta, read, ck, pc), param)
        if optimizer.keeps_master and "master" not in state[name]:
            state[name]["master"] = _load_param(name, param, meta["params"][name], meta["layout"]["tp"], read, pc)
    # Tensors read from a checkpoint are memory-mapped from its files: give the optimizer its own.
    state = {n: {k: v.clone() if v.device == pc.device else v for k, v in s.items()} for n, s in state.items()}
    optimizer.load_state_dict({"kind": optimizer.kind, "state": state})


def _param_value(
    name: str,
    param: torch.Tensor,
    meta: dict[str, Any],
    read: _Reader,
    ck: Path,
    pc: ParallelContext,
    from_master: bool,
) -> torch.Tensor:
    if from_master and name in meta["optim_files"]:
        master = _load_state(name, get_shard_spec(param), meta, read, ck, pc, keys=("master",))
        return ep_slice_state(master, param)["master"]
    return _load_param(name, param, meta["params"][name], meta["layout"]["tp"], read, pc)


def _clean_before_resume(path: Path, pc: ParallelContext) -> None:
    """`remove_leftovers` of the run directory that `path` is or holds the checkpoint of, by
    rank 0, before any rank looks for the newest checkpoint."""
    run_dir = path if (path / "checkpoints").is_dir() else path.parent.parent
    if pc.is_main and (run_dir == path or path.parent.name == "checkpoints"):
        remove_leftovers(run_dir)
    pc.barrier()


def _tokenizer_text(tok: dict[str, Any]) -> str:
    return f"{tok.get('name')} {str(tok.get('hash', ''))[:12]}".strip()


def check_data(ck: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """The stores a checkpoint was trained on (`saved`, from its meta.json) must be the ones
    it is now evaluated, resumed or used as a reference on (`current`): stores rebuilt from
    other inputs under the same path give another, plausible-looking loss. Skipped when either
    side is unknown (a checkpoint of an older version, a model trained outside the stores)."""
    if not saved or not current:
        return
    if saved.get("fingerprint") == current.get("fingerprint") and saved.get("tokenizer") == current.get("tokenizer"):
        return
    run = ck.parent.parent if ck.parent.name == "checkpoints" else ck
    raise CheckpointError(
        f"{run}: trained on stores {str(saved.get('fingerprint'))[:12]} (tokenizer "
        f"{_tokenizer_text(saved.get('tokenizer') or {})}), but the stores it would read now are "
        f"{str(current.get('fingerprint'))[:12]} (tokenizer {_tokenizer_text(current.get('tokenizer') or {})}); "
        f"point data.store_dir at the stores it was trained on, or train it again"
    )


def load_checkpoint(
    path_or_run_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    pc: ParallelContext,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load parameters (and the optimizer state unless None) into this rank's stage under its
    current layout and parameter precision; restore RNG states when the layout is unchanged.
    Collective (the parameter set is checked over all stages). A load with optimizer state is a
    resume: it first removes the leftovers of killed writes in the checkpoint's run directory.
    The model config and parameter set are checked before any tensor is copied, and each
    file's size and hash before it is read. `data`: the identity of the stores the caller
    reads (`check_data`). Returns the saved `extra`."""
    if optimizer is not None:
        _clean_before_resume(Path(path_or_run_dir), pc)
    ck = resolve_checkpoint(path_or_run_dir)
    meta = _read_meta(ck)
    check_data(ck, meta.get("data"), data)
    params = dict(model.named_parameters())
    _check_model_config(ck, meta.get("model"), model_config(model))
    _check_param_set(ck, meta["params"], params, pc)
    for name, param in params.items():
        _check_param(name, param, meta["params"][name], ck, pc)
    return _load_tensors(ck, meta, _Reader(ck, meta), params, optimizer, pc)


def _load_tensors(
    ck: Path,
    meta: dict[str, Any],
    read: _Reader,
    params: dict[str, torch.Tensor],
    optimizer: Optimizer | None,
    pc: ParallelContext,
) -> dict[str, Any]:
    from_master = optimizer is not None and not optimizer.keeps_master and meta.get("master_weights", False)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_param_value(name, param, meta, read, ck, pc, from_master))
    if optimizer is not None:
        _load_optimizer(optimizer, params, meta, read, ck, pc)
    # RNG states belong to a resumed run, not to a frozen model loaded beside another run.
    if optimizer is not None and meta["layout"] == {"tp": pc.tp, "pp": pc.pp, "dp": pc.dp}:
        _set_rng_state(read(f"rng_rank{pc.rank}.pt"), pc.device)
    return read("extra.pt")


def checkpoint_fingerprint(path_or_run_dir: str | os.PathLike) -> str:
    """What a checkpoint's model computes with, for results derived from it (a reference loss
    cache): a digest of its step and its model files' hashes. Another training run to the same
    path gives another fingerprint; a byte-identical one the same."""
    ck = resolve_checkpoint(path_or_run_dir)
    meta = _read_meta(ck)
    return _fingerprint_of(meta["step"], meta["files"])


def _fingerprint_of(step: int, files: dict[str, Any]) -> str:
    model_files = {n: f[HASH_KEY] for n, f in files.items() if n.startswith("model_")}
    text = json.dumps({"step": step, "model_files": model_files}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
