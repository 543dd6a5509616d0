"""The files of a Hugging Face model directory: `config.json` and the weights, one
`model.safetensors` or shards listed in `model.safetensors.index.json` (the layout of
transformers' `save_pretrained`).

Reading is lazy (`HFDir.get` opens each safetensors file once, memory-mapped, and reads one
tensor at a time), so that each rank of a parallel run reads only the tensors of its stage.
Writing splits the tensors into shards with huggingface_hub's `split_torch_state_dict_into_shards`
(the function `save_pretrained` uses) and writes them with `safetensors`. Both libraries are
imported on first use: the framework runs without them (`pip install doremi-mix[hf]`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from data.atomic import umask_mode
from trainer.hf.format import HFFormatError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise HFFormatError(
            "the Hugging Face format needs the safetensors package (pip install 'doremi-mix[hf]')"
        ) from None
    return safetensors


class HFDir:
    """A Hugging Face model directory opened for reading: `config` (config.json as a dict),
    `names` (every tensor name) and `get(name)` (one tensor, read on demand)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFFormatError(f"{self.path}: no such directory (expected a Hugging Face model directory)")
        config = self.path / CONFIG
        if not config.is_file():
            raise HFFormatError(f"{config}: missing (not a Hugging Face model directory)")
        self.config: dict[str, Any] = _read_json(config)
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}

    @functools.cached_property
    def _files(self) -> dict[str, str]:
        """Tensor name -> the file that holds it (looked up on first use: the config is checked
        first, so that a model of another architecture is named as such)."""
        index, single = self.path / INDEX, self.path / WEIGHTS
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise HFFormatError(f"{index}: no weight_map")
            for f in sorted(set(weight_map.values())):
                if not (self.path / f).is_file():
                    raise HFFormatError(f"{self.path / f}: missing (listed in {INDEX})")
            return dict(weight_map)
        if single.is_file():
            return dict.fromkeys(self._file(WEIGHTS).keys(), WEIGHTS)
        raise HFFormatError(f"{self.path}: no {WEIGHTS} or {INDEX} (only safetensors weights are read)")

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def _file(self, file: str):
        """The safetensors file `file`, opened once; one line when it is not a readable one."""
        if file not in self._open:
            safetensors = _safetensors()
            try:
                self._open[file] = safetensors.safe_open(str(self.path / file), framework="pt")
            except (safetensors.SafetensorError, OSError) as e:
                raise HFFormatError(f"{self.path / file}: not a readable safetensors file ({e})") from None
        return self._open[file]

    def _handle(self, name: str):
        if name not in self._files:
            raise HFFormatError(f"{self.path}: no tensor {name!r} in the weights")
        file = self._files[name]
        handle = self._file(file)
        if file not in self._keys:
            self._keys[file] = set(handle.keys())
        if name not in self._keys[file]:
            raise HFFormatError(f"{self.path / self._files[name]}: no tensor {name!r} (listed in {INDEX})")
        return handle

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except _safetensors().SafetensorError as e:
            raise HFFormatError(f"{self.path / self._files[name]}: tensor {name!r} cannot be read ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the file's header (no data read)."""
        return tuple(self._handle(name).get_slice(name).get_shape())


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; one line when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise HFFormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _as_os_error(e: Exception, path: Path) -> Exception:
    """safetensors reports a failed write (a full disk) as its own error with the OS error's
    number in the text (`... (os error 28) at path ...`): as an OSError naming `path`, the CLI
    prints it as one line. Anything else is returned as it was."""
    code = re.search(r"\(os error (\d+)\)", str(e))
    if code is None:
        return e
    n = int(code.group(1))
    return OSError(n, os.strerror(n), str(path))


def write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_size: int | str) -> list[str]:
    """Write `state` into `out` as `model.safetensors`, or as shards of at most `max_shard_size`
    (bytes, or a string such as "5GB") with `model.safetensors.index.json`, each file with the mode
    `open` gives under the umask. Returns the files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split = split_torch_state_dict_into_shards(
            state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
        )
    except ValueError as e:
        raise HFFormatError(f"--max-shard-size: {e}") from None
    save_file = _safetensors().torch.save_file
    for file, names in split.filename_to_tensors.items():
        try:
            save_file({n: state[n] for n in names}, str(out / file), metadata={"format": "pt"})
        except Exception as e:
            raise _as_os_error(e, out / file) from None
        os.chmod(out / file, umask_mode(0o666))  # safetensors writes 0600; open() would give this
    files = sorted(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files
