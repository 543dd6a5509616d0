"""The Hugging Face Llama format (trainer/hf/format.py, doremi/commands/hf.py): import from and export to
`transformers` with the same logits, a (2,2,2) checkpoint exported, bitwise round trips, bf16,
sharded weights, the tokenizers, generation, and the one-line errors (no download: the
transformers models are built from small LlamaConfigs)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.runs import config, run_stage
from tests.test_cli import BIN, ROOT

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from doremi.commands.hf import export, import_sections  # noqa: E402
from trainer.config.presets import PRESETS  # noqa: E402
from trainer.config.schema import ModelConfig  # noqa: E402
from trainer.config.tools import from_dict  # noqa: E402
from trainer.hf.format import HFFormatError, from_hf_state, model_keys_from_hf, to_hf_config, to_hf_state  # noqa: E402
from trainer.hf.init import load_hf_weights  # noqa: E402
from trainer.model.llama import Llama  # noqa: E402
from trainer.parallel.context import ParallelContext  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
TOKENS = torch.tensor([[1, 5, 9, 17, 33, 2, 64, 100, 7, 7, 3, 250, 11, 0, 4, 8]])


def hf_llama(tmp_path: Path, **kw) -> Path:
    """A random transformers Llama (norm weights random too), saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=261, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(**(shape | dict(num_key_value_heads=2, max_position_embeddings=64) | kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    return out


def imported(hf_dir: Path) -> Llama:
    cfg = from_dict(ModelConfig, {k: v for k, v in import_sections(hf_dir)["model"].items() if k != "init_from_hf"})
    model = Llama(dataclasses.replace(cfg, attention="sdpa"))
    load_hf_weights(model, model.cfg, hf_dir, ParallelContext.single())
    return model


def our_logits(model: Llama, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(None, {"input_ids": tokens})


def hf_logits(hf_dir: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 8,
}


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # GQA (2 kv heads for 4), untied, a vocabulary that our model pads (261 -> 320)
        dict(tie_word_embeddings=True, num_key_value_heads=4, rms_norm_eps=1e-5),
        dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    ],
    ids=["gqa-untied", "tied-mha", "llama3-rope"],
)
def test_import_gives_transformers_logits(tmp_path, kw):
    hf_dir = hf_llama(tmp_path, **kw)
    model = imported(hf_dir)
    assert model.embed.weight.shape[0] == 320 and model.embed.weight[261:].abs().sum() == 0
    if "rope_scaling" in kw:
        assert model.cfg.rope_scaling is not None and model.cfg.rope_scaling.factor == 4.0
    torch.testing.assert_close(our_logits(model), hf_logits(hf_dir), **TOL)


def test_import_prints_the_model_section(tmp_path):
    hf_dir = hf_llama(tmp_path)
    sections = import_sections(hf_dir)
    assert sections["model"]["init_from_hf"] == str(hf_dir.resolve())
    assert sections["model"]["n_kv_heads"] == 2 and sections["model"]["vocab_size"] == 261


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_map_both_ways(name):
    cfg = from_dict(ModelConfig, PRESETS[name])
    if cfg.moe is not None or "M" in cfg.block_pattern:
        with pytest.raises(
            HFFormatError, match=r"^model\.(moe|block_pattern): a Llama config.json maps the plain Llama"
        ):
            to_hf_config(cfg, torch.bfloat16, 0)
        return
    keys = model_keys_from_hf(to_hf_config(cfg, torch.bfloat16, 0))
    ours = dataclasses.asdict(cfg)
    assert {k: ours[k] for k in keys} == keys


def test_state_maps_both_ways_bitwise():
    cfg = ModelConfig(vocab_size=100, tie_embeddings=False)
    state = {n: p.detach().clone() for n, p in Llama(cfg, seed=3).named_parameters()}
    hf = to_hf_state(state, cfg)
    assert hf["model.embed_tokens.weight"].shape[0] == 100 and "lm_head.weight" in hf
    back = from_hf_state(hf, cfg, rows=state["embed.weight"].shape[0])
    assert back.keys() == state.keys() and all(torch.equal(back[n], state[n]) for n in state)


# -- export of trained runs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory):
    """A tied run trained at (tp, pp, dp) = (2, 2, 2) and an untied one with bf16 parameters."""
    root = tmp_path_factory.mktemp("hf_runs")
    spawn(
        run_stage,
        8,
        "train",
        str(stores),
        [
            (
                str(root / "t222"),
                [
                    "parallelism.tp=2",
                    "parallelism.pp=2",
                    "parallelism.dp=2",
                    "train.micro_batches=2",
                    "model.tie_embeddings=true",
                ],
            )
        ],
    )
    run_stage(0, 1, "train", str(stores), [(str(root / "bf16"), ["train.param_dtype=bf16", "train.steps=2"])])
    return root


def trained(stores: Path, run: Path, *sets: str) -> Llama:
    """The run's last checkpoint in a single-process fp32 model (its config: the test config + `sets`)."""
    from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint

    cfg = config(stores, run.with_name(run.name + "-load"), *sets).model
    model = Llama(dataclasses.replace(cfg, attention="sdpa"))
    load_checkpoint(latest_checkpoint(run), model, None, ParallelContext.single())
    return model


def test_export_of_222_checkpoint_loads_in_transformers(runs, stores, tmp_path):
    out = tmp_path / "hf"
    files = export(runs / "t222", out)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"] and hf_cfg["vocab_size"] == 260 and hf_cfg["dtype"] == "float32"
    model = trained(stores, runs / "t222", "model.tie_embeddings=true")
    params = dict(model.named_parameters())
    torch.testing.assert_close(hf_logits(out), our_logits(model), **TOL)
    # import(export(x)) is x, bit for bit (the padded vocabulary rows, zero in both, included)
    back = dict(imported(out).named_parameters())
    assert back.keys() == params.keys() and all(torch.equal(back[n], params[n]) for n in params)


def test_bf16_export_sharded(runs, stores, tmp_path):
    out = tmp_path / "hf"
    files = export(runs / "bf16", out, max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "model.safetensors.index.json" in files
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and "lm_head.weight" in dict(model.named_parameters())
    back = dict(imported(out).named_parameters())
    ours = dict(trained(stores, runs / "bf16").named_parameters())
    assert back.keys() == ours.keys() and all(torch.equal(back[n], ours[n]) for n in ours)


def test_generate_from_an_export(runs, tmp_path):
    out = tmp_path / "hf"
    export(runs / "t222", out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    ids = tok("ab ab", return_tensors="pt").input_ids
    assert ids.tolist() == [list(b"ab ab")]  # the byte tokenizer's ids
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 6) or gen[0, -1] == tok.eos_token_id
    assert isinstance(tok.decode(gen[0]), str)


def test_bpe_tokenizer_exports(tmp_path):
    from data.tokenizer.export import tokenizer_files
    from data.tokenizer.tokenizer import train_bpe

    bpe = train_bpe(["the cat sat on the mat, the end. " * 20, "doremi mixes domains"], 300)
    for name, text in tokenizer_files(bpe, 64).items():
        (tmp_path / name).write_text(text)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "the cat mixes domains"
    assert tok(text).input_ids == bpe.encode(text) and tok.eos_token_id == bpe.eos_id


# -- errors ---------------------------------------------------------------------------------------


def doremi_error(*args) -> str:
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(BIN / "doremi"), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def test_what_does_not_map_is_one_line(tmp_path):
    hf_dir = hf_llama(tmp_path)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "model_type is 'gpt2'" in doremi_error("import", gpt2)
    (hf_dir / "model.safetensors").unlink()
    assert "no model.safetensors" in doremi_error("import", hf_dir)
    assert "config.json: missing" in doremi_error("import", tmp_path)
    with pytest.raises(HFFormatError, match="rope_scaling type 'yarn'"):
        model_keys_from_hf(
            {**to_hf_config(ModelConfig(vocab_size=256), torch.float32, 0), "rope_scaling": {"rope_type": "yarn"}}
        )


def test_init_from_hf_checks_the_model_shape(tmp_path):
    hf_dir = hf_llama(tmp_path)
    with pytest.raises(HFFormatError, match="model.d_model is 64 but 32 there"):
        load_hf_weights(
            Llama(ModelConfig(vocab_size=261)), ModelConfig(vocab_size=261), hf_dir, ParallelContext.single()
        )


def test_export_writes_all_or_nothing(runs, tmp_path, monkeypatch):
    import doremi.commands.hf

    out = tmp_path / "hf"

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(doremi.commands.hf, "write_weights", fail)
    with pytest.raises(OSError):
        export(runs / "t222", out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    export(runs / "t222", out)
    assert "exists and is not empty" in doremi_error("export", runs / "t222", out)
    assert "no checkpoint found" in doremi_error("export", tmp_path / "nothing", tmp_path / "o2")


def test_readme_commands(runs, stores, tmp_path):
    """The README's Hugging Face commands: export, import, and a run that starts from the export
    (with lr 1e-30 its parameters stay the exported ones, bit for bit)."""
    from tests.runs import config_path
    from tests.test_cli import doremi

    out, cfg = tmp_path / "hf", config_path(stores, tmp_path / "exp")
    doremi("export", runs / "t222", out)
    section = doremi("import", out, "--out", tmp_path / "from-hf.yaml")
    assert f"init_from_hf: {out}" in section and (tmp_path / "from-hf.yaml").read_text() == section
    tied, run = "model.tie_embeddings=true", tmp_path / "from-hf"
    sets = [
        tied,
        f"model.init_from_hf={out}",
        f"train.run_dir={run}",
        "train.steps=1",
        "train.lr=1e-30",
        "train.min_lr=0",
    ]
    doremi("train", cfg, *[a for s in sets for a in ("--set", s)])
    ours, start = dict(trained(stores, run, tied).named_parameters()), dict(imported(out).named_parameters())
    assert all(torch.equal(ours[n], start[n]) for n in start)
