"""`doremi export` and `doremi import`: models out of and into the Hugging Face ecosystem.

Export writes a transformers Llama directory (`config.json`, `generation_config.json`, the
weights as safetensors, sharded above `--max-shard-size`, and the run's tokenizer as
`tokenizer.json` + `tokenizer_config.json`) from a checkpoint of any layout and parameter
precision: the checkpoint is loaded into a single-process model on the CPU by the checkpoint
loader (which reassembles any tp / pp / dp layout), mapped by `trainer.hf.format`, and written in
the checkpoint's parameter dtype. Everything is written into a staging directory beside OUT_DIR
and renamed into place at the end: an error leaves no OUT_DIR, and an existing one is replaced
only with `--force`, after the new one is complete.

Import checks that a Hugging Face directory maps (a Llama, safetensors weights holding exactly
the tensors of the model) and prints the `model` section of a run that starts from it (its shape
and `model.init_from_hf: DIR`; the weights are read by the run itself at its own layout,
`trainer.hf.init`), plus the `data.tokenizer` that tokenizes stores with its tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from data import artifact
from data.atomic import atomic_write_text, staging_dir
from data.errors import UserError
from data.tokenizer.export import tokenizer_files
from data.tokenizer.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from doremi.reports.outputs import is_ours
from trainer.checkpoint.checkpoint import META, checkpoint_fingerprint, load_checkpoint, resolve_checkpoint
from trainer.config.schema import ModelConfig
from trainer.config.tools import ConfigError, from_dict, read_yaml
from trainer.hf.files import CONFIG, HFDir, write_weights
from trainer.hf.format import (
    HFFormatError,
    check_plain_llama,
    hf_shapes,
    model_keys_from_hf,
    to_hf_config,
    to_hf_state,
)
from trainer.parallel.context import ParallelContext

DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Tensors some HF checkpoints carry that are not parameters (older transformers saved RoPE's).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# -- export -------------------------------------------------------------------------------------


def checkpoint_model_config(meta: dict[str, Any], ck: Path) -> ModelConfig:
    """The checkpoint's model config (meta.json), set to run on the CPU."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise HFFormatError(f"{ck}: checkpoint records no model config (written by an older version)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = from_dict(ModelConfig, {k: v for k, v in saved.items() if k in known}, "model")
    return dataclasses.replace(cfg, attention="sdpa", compile=False, init_from_hf=None)


def checkpoint_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The dtype the checkpoint's parameters were saved in (what its run computed with)."""
    names = {info["dtype"] for info in meta["params"].values()}
    return getattr(torch, names.pop()) if len(names) == 1 else torch.float32


def run_tokenizer(ck: Path, meta: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of the stores the checkpoint was trained on (its run's `data.store_dir`),
    checked against the identity the checkpoint recorded."""
    run = ck.parent.parent if ck.parent.name == "checkpoints" else ck
    hint = "; --no-tokenizer exports the model alone"
    saved = run / "config.yaml"
    if not saved.is_file():
        raise HFFormatError(f"cannot export the tokenizer: {saved} is missing{hint}")
    store_dir = (read_yaml(saved).get("data") or {}).get("store_dir")
    try:
        tok = load_tokenizer(store_dir)
    except (UserError, OSError) as e:
        raise HFFormatError(f"cannot export the tokenizer: {e}{hint}") from None
    recorded = (meta.get("data") or {}).get("tokenizer") or {}
    if recorded.get("hash") not in (None, tok.identity["hash"]):
        raise HFFormatError(
            f"cannot export the tokenizer: the stores in {store_dir} now hold tokenizer {tok.identity['name']}, "
            f"not the {recorded.get('name')} the checkpoint was trained with{hint}"
        )
    return tok


def hf_directory_files(ck: Path, with_tokenizer: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The weights (HF names) and the JSON/text files of the export of checkpoint `ck`."""
    meta = json.loads((ck / META).read_text())
    cfg = checkpoint_model_config(meta, ck)
    check_plain_llama(cfg, "doremi export")
    tok = run_tokenizer(ck, meta) if with_tokenizer else None
    from trainer.model.llama import Llama

    model = Llama(cfg)
    load_checkpoint(ck, model, None, ParallelContext.single())
    dtype = checkpoint_dtype(meta)
    state = to_hf_state(dict(model.named_parameters()), cfg, dtype)
    eos = tok.eos_id if tok is not None else (meta.get("data") or {}).get("tokenizer", {}).get("eos_id")
    generation = {"eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None}
    files = {
        CONFIG: json.dumps(to_hf_config(cfg, dtype, eos), indent=2) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }
    if tok is not None:
        files |= tokenizer_files(tok, cfg.max_seq_len)
    return state, files


def _check_out(out: Path, force: bool) -> None:
    """An existing, non-empty OUT_DIR is replaced only with --force and only if it is an export
    (its `artifact.json`; docs/design.md section 6b): never a run, a file or a folder of files."""
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise HFFormatError(f"{out}: exists and is not empty (choose another OUT_DIR, or --force to replace it)")
    artifact.check_replaceable(out, "export", "doremi export --force")


def export(
    source: str | Path,
    out_dir: str | Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    with_tokenizer: bool = True,
    force: bool = False,
) -> list[str]:
    """Export the checkpoint `source` (a run or checkpoint directory) into `out_dir` as a
    Hugging Face Llama directory. Returns the files written."""
    out = Path(out_dir)
    _check_out(out, force)
    ck = resolve_checkpoint(source)
    state, files = hf_directory_files(ck, with_tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out.parent, prefix=f".{out.name}.")
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        written = write_weights(state, staging, max_shard_size)
        header = artifact.Header(
            "export",
            fingerprint=checkpoint_fingerprint(ck),
            sources=[artifact.Source("checkpoint", str(ck), checkpoint_fingerprint(ck))],
            files=artifact.hash_files(staging, [*files, *written]),
        )
        artifact.write(staging, header)
        _check_out(out, force)
        artifact.replace_dir(staging, out, "export", "doremi export --force")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted([*files, *written])


# -- import -------------------------------------------------------------------------------------


def check_tensors(hf: HFDir, cfg: ModelConfig) -> None:
    """The directory holds every tensor of the model, each of the shape its config.json implies,
    and none that does not map (shapes from the files' headers: no weight is read)."""
    shapes = hf_shapes(cfg)
    missing = sorted(set(shapes) - hf.names)
    if missing:
        raise HFFormatError(f"{hf.path}: no tensor {missing[0]!r} in the weights ({len(missing)} missing)")
    tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = sorted(n for n in hf.names - set(shapes) - tied_head if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise HFFormatError(f"{hf.path}: tensor {extra[0]!r} does not map onto this framework's Llama")
    for name, want in sorted(shapes.items()):
        got = hf.shape(name)
        if got != want:
            raise HFFormatError(f"{hf.path}: tensor {name!r} has shape {list(got)}, {CONFIG} implies {list(want)}")


def _tokenizer_section(path: Path) -> dict[str, Any] | None:
    """`data.tokenizer` reading the directory's tokenizer.json, or None without one."""
    if not (path / "tokenizer.json").is_file():
        return None
    section: dict[str, Any] = {"kind": "hf", "path": str(path)}
    config = path / "tokenizer_config.json"
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        section["eos_token"] = eos
    return section


def import_sections(hf_dir: str | Path) -> dict[str, Any]:
    """The config sections of a run that starts from the Hugging Face directory `hf_dir`."""
    hf = HFDir(Path(hf_dir).resolve())
    keys = model_keys_from_hf(hf.config, str(hf.path / CONFIG))
    try:
        cfg = from_dict(ModelConfig, keys, "model")
    except ConfigError as e:
        raise HFFormatError(f"{hf.path / CONFIG}: {e}") from None
    check_tensors(hf, cfg)
    sections: dict[str, Any] = {"model": {**keys, "init_from_hf": str(hf.path)}}
    tokenizer = _tokenizer_section(hf.path)
    if tokenizer is not None:
        sections["data"] = {"tokenizer": tokenizer}
    return sections


#: The first line of what `doremi import --out` writes: how it knows a file as its own.
IMPORT_LINE = "# doremi import "


def import_yaml(hf_dir: str | Path, out: str | Path | None = None) -> str:
    """`import_sections` as YAML (written atomically to `out` when given). An existing `out` is
    replaced only if this command wrote it (its first line): an experiment file given as `--out`
    was overwritten with the model section alone (docs/design.md section 6b)."""
    if out is not None:
        o = Path(out)
        if o.exists() and not is_ours(o):
            raise artifact.ArtifactError(
                f"{o}: exists and was not written by `doremi import`; `doremi import --out` replaces only its own "
                f"output: choose another path"
            )
    sections = import_sections(hf_dir)
    text = f"{IMPORT_LINE}{sections['model']['init_from_hf']}: merge into an experiment file\n"
    text += yaml.safe_dump(sections, sort_keys=False)
    if out is not None:
        atomic_write_text(out, text)
    return text
