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
from pathlib import Path
from typing import Any

import torch

from trainer.hf_format import HFFormatError

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
        try:
            self.config: dict[str, Any] = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise HFFormatError(f"{config}: not valid JSON ({e})") from None
        self._open: dict[str, Any] = {}

    @functools.cached_property
    def _files(self) -> dict[str, str]:
        """Tensor name -> the file that holds it (looked up on first use: the config is checked
        first, so that a model of another architecture is named as such)."""
        index, single = self.path / INDEX, self.path / WEIGHTS
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFFormatError(f"{index}: no weight_map")
            for f in sorted(set(weight_map.values())):
                if not (self.path / f).is_file():
                    raise HFFormatError(f"{self.path / f}: missing (listed in {INDEX})")
            return dict(weight_map)
        if single.is_file():
            with _safetensors().safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), WEIGHTS)
        raise HFFormatError(f"{self.path}: no {WEIGHTS} or {INDEX} (only safetensors weights are read)")

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise HFFormatError(f"{self.path}: no tensor {name!r} in the weights")
        file = self._files[name]
        if file not in self._open:
            self._open[file] = _safetensors().safe_open(str(self.path / file), framework="pt")
        return self._open[file].get_tensor(name)


def write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_size: int | str) -> list[str]:
    """Write `state` into `out` as `model.safetensors`, or as shards of at most `max_shard_size`
    (bytes, or a string such as "5GB") with `model.safetensors.index.json`. Returns the files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split = split_torch_state_dict_into_shards(
            state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
        )
    except ValueError as e:
        raise HFFormatError(f"--max-shard-size: {e}") from None
    save_file = _safetensors().torch.save_file
    for file, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(out / file), metadata={"format": "pt"})
    files = sorted(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files
