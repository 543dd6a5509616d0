"""Hugging Face export and import refuse what does not map, in one line, leaving nothing behind:

- `doremi export` of MoE, hybrid and muP runs: one line naming the config key, exit 2, no
  OUT_DIR; `--force` over a file leaves no `.old.tmp` behind. `model.init_from_hf` into a muP,
  MoE or hybrid model is refused (a muP model loaded, and computed another function);
- `doremi import` of a directory whose config.json disagrees with the tensors' shapes, is not a
  JSON object, holds non-numbers, or whose safetensors or index are damaged: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.runs import config
from tests.test_cli import BIN, ROOT
from trainer.config.moe import MoEConfig
from trainer.config.schema import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# -- Hugging Face ---------------------------------------------------------------------------------

pytest.importorskip("safetensors")
pytest.importorskip("huggingface_hub")


def doremi_error(*args) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(BIN / "doremi"), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def test_export_of_moe_hybrid_mup_is_one_line_and_writes_nothing(stores, tmp_path):
    from doremi.commands.hf import export
    from trainer.hf.format import HFFormatError

    cases = {
        "moe": (["model.moe.num_experts=4"], r"^model.moe: doremi export maps the plain Llama only"),
        "hybrid": (["model.preset=hybrid-tiny"], r"^model.block_pattern: doremi export maps .* got 'MA'"),
        "mup": (["model.mup.base_width=32"], r"^model.mup: doremi export maps the plain Llama only"),
    }
    for name, (sets, match) in cases.items():
        stages.train(config(stores, tmp_path / name, *sets, "train.steps=1"))
        with pytest.raises(HFFormatError, match=match):
            export(tmp_path / name, tmp_path / "out", with_tokenizer=False)
        assert not (tmp_path / "out").exists()
    assert "model.moe: doremi export" in doremi_error("export", tmp_path / "moe", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["hybrid", "moe", "mup"]


def test_export_force_replaces_only_an_export_and_leaves_nothing_behind(stores, tmp_path):
    """--force replaces an earlier export; a file or a folder that is not one is refused and kept
    (issue 41: the tool deletes only what it made)."""
    from data.artifact import ArtifactError
    from doremi.commands.hf import export

    stages.train(config(stores, tmp_path / "run", "train.steps=1"))
    (tmp_path / "out").write_text("a file\n")
    with pytest.raises(ArtifactError, match="replaces only its own output"):
        export(tmp_path / "run", tmp_path / "out", with_tokenizer=False, force=True)
    assert (tmp_path / "out").read_text() == "a file\n"
    export(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    export(tmp_path / "run", tmp_path / "hf", with_tokenizer=False, force=True)
    assert (tmp_path / "hf" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _hf_dir(tmp_path: Path, cfg: ModelConfig) -> Path:
    """An HF Llama directory written by our own mapping (no transformers needed)."""
    from trainer.hf.files import write_weights
    from trainer.hf.format import to_hf_config, to_hf_state
    from trainer.model.llama import Llama

    out = tmp_path / "hf"
    out.mkdir()
    state = to_hf_state(dict(Llama(cfg, seed=0).named_parameters()), cfg)
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg, torch.float32, 0)))
    write_weights(state, out, "5GB")
    return out


def _edit_config(hf: Path, **changes) -> None:
    config_json = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config_json | changes))


LLAMA = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


@pytest.mark.parametrize(
    "damage,match",
    [
        (
            lambda d: _edit_config(d, intermediate_size=64),
            r"'model.layers.0.mlp.down_proj.weight' has shape \[32, 48\]",
        ),
        (lambda d: _edit_config(d, num_key_value_heads=4), r"k_proj.weight' has shape \[16, 32\], config.json implies"),
        (lambda d: _edit_config(d, hidden_size="32"), r"config.json: hidden_size is '32', expected an integer"),
        (lambda d: _edit_config(d, rms_norm_eps=[1]), r"config.json: rms_norm_eps is \[1\], expected a number"),
        (lambda d: _edit_config(d, num_attention_heads=3, head_dim=None), r"config.json: model.d_model: expected"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), r"config.json: expected a JSON object, got list"),
        (lambda d: os.truncate(d / "model.safetensors", 50), r"model.safetensors: not a readable safetensors file"),
        (
            lambda d: (d / "model.safetensors.index.json").write_text("{"),
            r"model.safetensors.index.json: not valid JSON",
        ),
    ],
    ids=["ffn-shape", "kv-shape", "string", "list", "heads", "not-object", "truncated", "bad-index"],
)
def test_import_of_a_damaged_directory_is_one_line(tmp_path, damage, match):
    from doremi.commands.hf import import_sections
    from trainer.hf.format import HFFormatError

    hf = _hf_dir(tmp_path, LLAMA)
    assert import_sections(hf)["model"]["ffn_dim"] == 48
    damage(hf)
    with pytest.raises(HFFormatError, match=match) as err:
        import_sections(hf)
    assert "\n" not in str(err.value)


def test_import_cli_exit_2_on_shape_mismatch(tmp_path):
    hf = _hf_dir(tmp_path, LLAMA)
    _edit_config(hf, intermediate_size=64)
    assert "has shape [32, 48], config.json implies [32, 64]" in doremi_error("import", hf)


def test_init_from_hf_refuses_models_that_are_not_the_plain_llama(tmp_path):
    import dataclasses

    from trainer.config.mup import MupConfig
    from trainer.hf.format import HFFormatError
    from trainer.hf.init import load_hf_weights
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    hf = _hf_dir(tmp_path, LLAMA)
    cases = [
        (dataclasses.replace(LLAMA, mup=MupConfig(base_width=16)), r"^model.mup: model.init_from_hf maps the plain"),
        (dataclasses.replace(LLAMA, moe=MoEConfig(num_experts=4, top_k=2)), r"^model.moe: model.init_from_hf maps"),
        (dataclasses.replace(LLAMA, block_pattern="MA"), r"^model.block_pattern: model.init_from_hf maps"),
    ]
    for cfg, match in cases:
        model = Llama(cfg)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(HFFormatError, match=match):
            load_hf_weights(model, cfg, hf, ParallelContext.single())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    plain, source = Llama(LLAMA, seed=5), dict(Llama(LLAMA, seed=0).named_parameters())
    load_hf_weights(plain, LLAMA, hf, ParallelContext.single())
    for name, p in plain.named_parameters():
        assert torch.equal(p[:100], source[name][:100]), name


def test_import_out_replaces_only_its_own_output(tmp_path):
    """`doremi import HF --out experiment.yaml` overwrote the experiment file with the model
    section alone; a file it wrote itself is replaced."""
    from doremi.commands.hf import import_yaml

    hf = _hf_dir(tmp_path, LLAMA)
    mine = tmp_path / "experiment.yaml"
    mine.write_text("train: {steps: 3}\n")
    assert f"{mine}: exists and was not written by `doremi import`" in doremi_error("import", hf, "--out", mine)
    assert mine.read_text() == "train: {steps: 3}\n"
    out = tmp_path / "model.yaml"
    text = import_yaml(hf, out)
    assert import_yaml(hf, out) == text == out.read_text()
