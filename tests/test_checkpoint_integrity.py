"""Checkpoints never load into a silently wrong state (issue 18): a checkpoint of another model,
corrupted bytes, a reference cache scored with other weights, and the leftovers of killed writes.
All single-process; the resharding tests of test_checkpoint.py run the new checks too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from doremi.errors import DoReMiError
from doremi.methods.reference import CACHE_VERSION, CachedReference
from doremi.methods.reference_cache import open_cache
from tests.test_checkpoint import toy_run
from tests.test_zero_optim import build_stage, dp_step, full_tensors, toy_specs
from trainer.build import build_model
from trainer.checkpoint.checkpoint import (
    CheckpointError,
    checkpoint_fingerprint,
    file_hash,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
)
from trainer.config.schema import load_config
from trainer.parallel.context import ParallelContext

PC = ParallelContext.single()


# -- 2. a checkpoint of another model --------------------------------------------------------------


def llama(*overrides: str) -> torch.nn.Module:
    """The default tiny Llama (vocab 256, width 64, 2 layers, 4 heads, 2 kv heads)."""
    return build_model(load_config(None, ["train.device=cpu", "model.vocab_size=256", *overrides]), PC)


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layers=1"], "model.n_layers is 2 in the checkpoint but 1 now"),
        (["model.tie_embeddings=true"], "model.tie_embeddings is false in the checkpoint but true now"),
        (
            ["model.n_heads=8", "model.n_kv_heads=4"],
            "model.n_heads is 4 in the checkpoint but 8 now; model.n_kv_heads is 2 in the checkpoint but 4 now",
        ),
        (["model.vocab_size=250"], "model.vocab_size is 256 in the checkpoint but 250 now"),
    ],
)
def test_checkpoint_of_another_model_config_is_refused(tmp_path, overrides, message):
    ck = save_checkpoint(tmp_path, 1, llama(), None, PC, {"step": 1})
    assert json.loads((ck / "meta.json").read_text())["model"]["n_layers"] == 2
    other = llama(*overrides)
    if overrides[0].startswith(("model.n_heads", "model.vocab")):
        assert shapes(other) == shapes(llama())  # only the recorded config tells them apart
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck, other, None, PC)
    assert str(err.value) == f"checkpoint {ck}: {message}"
    load_checkpoint(ck, llama("model.attention=sdpa", "model.init_std=0.1"), None, PC)  # not architecture


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
HYBRID = ["model.block_pattern=MA", "model.mamba.head_dim=16"]


@pytest.mark.parametrize(
    "base, overrides, message",
    [
        (MOE, ["model.moe.top_k=1"], "model.moe.top_k is 2 in the checkpoint but 1 now"),
        (MOE, ["model.moe.gating=sigmoid"], "model.moe.gating is softmax in the checkpoint but sigmoid now"),
        (
            MOE,
            ["model.moe.normalize_top_k=false"],
            "model.moe.normalize_top_k is true in the checkpoint but false now",
        ),
        (MOE, ["model.moe.layers=[0]"], "model.moe.layers is [0, 1] in the checkpoint but [0] now"),
        (
            ["model.mup.base_width=32"],
            ["model.mup.base_width=16"],
            "model.mup.base_width is 32 in the checkpoint but 16 now",
        ),
        (["model.mup.base_width=32"], ["model.mup=null"], "model.mup.base_width is 32 in the checkpoint but null now"),
        (HYBRID, ["model.mamba.ngroups=2"], "model.mamba.ngroups is 1 in the checkpoint but 2 now"),
    ],
)
def test_checkpoint_of_another_moe_mamba_or_mup_model_is_refused(tmp_path, base, overrides, message):
    """Keys of the optional parts that change the function, some without changing any shape."""
    ck = save_checkpoint(tmp_path, 1, llama(*base), None, PC, {"step": 1})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck, llama(*base, *overrides), None, PC)
    assert str(err.value) == f"checkpoint {ck}: {message}"
    load_checkpoint(ck, llama(*base, "model.moe.aux_loss_coef=0.5") if base is MOE else llama(*base), None, PC)


def toy(names_from: dict, drop: tuple[str, ...] = ()) -> torch.nn.Module:
    specs = {n: s for n, s in names_from.items() if not n.startswith(drop)}
    return build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)


def test_parameter_set_is_checked_both_ways(tmp_path):
    """Models without a recorded config (the toy stages) are told apart by their parameters:
    fewer layers, a tied model from an untied checkpoint (its head left behind) and back."""
    untied, tied = toy_specs(tied=False), toy_specs(tied=True)
    ck = save_checkpoint(tmp_path, 1, toy(untied), None, PC, {"step": 1})
    with pytest.raises(
        CheckpointError,
        match=r"holds parameter 'layers.3.down.weight', 'layers.3.norm.weight', "
        r"'layers.3.up.weight' that the model lacks",
    ):
        load_checkpoint(ck, toy(untied, drop=("layers.3",)), None, PC)
    with pytest.raises(CheckpointError, match=r"holds parameter 'head.weight' that the model lacks"):
        load_checkpoint(ck, toy(tied), None, PC)
    tied_ck = save_checkpoint(tmp_path / "tied", 1, toy(tied), None, PC, {"step": 1})
    with pytest.raises(CheckpointError, match=r"has no parameter 'head.weight' of the model"):
        load_checkpoint(tied_ck, toy(untied), None, PC)


# -- 3. corrupted content --------------------------------------------------------------------------


@pytest.mark.parametrize("file", ["model_pp0_tp0.pt", "optim_pp0_tp0_dp0.pt"])
def test_flipped_bytes_are_detected(tmp_path, file):
    model, opt = toy_run()
    dp_step(model, opt, PC, 0)
    ck = save_checkpoint(tmp_path, 1, model, opt, PC, {"step": 1})
    meta = json.loads((ck / "meta.json").read_text())
    assert {n: f["xxh3_64"] for n, f in meta["files"].items()} == {
        f.name: file_hash(f) for f in ck.iterdir() if f.name != "meta.json"
    }
    target = ck / file
    data = bytearray(target.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    target.write_bytes(bytes(data))
    fresh, opt2 = toy_run(1)
    with pytest.raises(
        CheckpointError,
        match=rf"{file}: corrupted checkpoint file \(XXH3-64 [0-9a-f]{{16}}, "
        rf"meta.json records {meta['files'][file]['xxh3_64']}\)",
    ):
        load_checkpoint(ck, fresh, opt2, PC)


# -- 4. a stale reference cache --------------------------------------------------------------------


def write_cache(cache: Path, reference: Path, fingerprint: str | None) -> None:
    cache.mkdir()
    np.save(cache / "a.npy", np.zeros((4, 8), dtype=np.float32))
    (cache / "meta.json").write_text(
        json.dumps(
            {
                "version": CACHE_VERSION,
                "domains": ["a"],
                "seq_len": 8,
                "reference": str(reference),
                "reference_fingerprint": fingerprint,
                "steps": 1,
                "global_batch_size": 2,
                "seed": 0,
                "sampling": [1.0],
            }
        )
    )


def cached(cache: Path, reference: Path) -> CachedReference:
    arrays = open_cache(cache, ["a"], 8, steps=1, global_batch_size=2, seed=0, sampling=[1.0], reference=str(reference))
    return CachedReference(cache, ["a"], arrays, torch.device("cpu"))


def test_cache_of_a_reference_trained_again_to_the_same_path_is_refused(tmp_path):
    run = tmp_path / "reference"
    model, _ = toy_run(0)
    ck = save_checkpoint(run, 3, model, None, PC, {"step": 3})
    scored = checkpoint_fingerprint(ck)
    write_cache(tmp_path / "cache", ck, scored)
    cached(tmp_path / "cache", run)
    moved = shutil.copytree(run, tmp_path / "moved")  # the same weights elsewhere: still valid
    cached(tmp_path / "cache", moved)
    again, _ = toy_run(1)
    save_checkpoint(run, 3, again, None, PC, {"step": 3})
    now = checkpoint_fingerprint(run)
    assert now != scored
    with pytest.raises(DoReMiError) as err:
        cached(tmp_path / "cache", run)
    assert str(err.value) == (
        f"{tmp_path / 'cache' / 'meta.json'}: cache was scored with reference {ck} "
        f"(fingerprint {scored}), the run's reference {ck} has fingerprint {now} "
        f"(run `doremi score` again)"
    )
    write_cache(tmp_path / "old", ck, None)
    (tmp_path / "old" / "meta.json").write_text(
        json.dumps({**json.loads((tmp_path / "old" / "meta.json").read_text()), "version": 1})
    )
    with pytest.raises(DoReMiError, match=r"reference cache version 1, this code reads version 2"):
        cached(tmp_path / "old", run)


# -- leftovers of killed writes --------------------------------------------------------------------


def leftovers(run: Path) -> tuple[Path, torch.nn.Module, object]:
    """Two complete checkpoints, then what kills leave: an unfinished write, a step directory
    without meta.json, a pruning cut short, an overwrite of step 2 cut between its renames."""
    model, opt = toy_run()
    dp_step(model, opt, PC, 0)
    save_checkpoint(run, 1, model, opt, PC, {"step": 1})
    save_checkpoint(run, 2, model, opt, PC, {"step": 2})
    root = run / "checkpoints"
    (root / "step_0000003.tmp").mkdir()
    (root / "step_0000003.tmp" / ".model_pp0_tp0.pt.abc.tmp").write_bytes(b"partial")
    (root / "step_0000004").mkdir()
    (root / "step_0000004" / "extra.pt").write_bytes(b"x")
    (root / "step_0000000.pruned.tmp").mkdir()
    (root / "step_0000002").rename(root / "step_0000002.old.tmp")
    return root, model, opt


def test_leftovers_are_removed_at_resume_never_a_checkpoint(tmp_path):
    root, model, opt = leftovers(tmp_path)
    assert load_checkpoint(tmp_path, model, None, PC) == {"step": 1}  # a frozen load changes nothing
    assert len(list(root.iterdir())) == 5
    assert load_checkpoint(tmp_path, model, opt, PC) == {"step": 2}
    kept = sorted(d.name for d in root.iterdir())
    assert kept[:2] == ["step_0000001", "step_0000002"]  # a step without meta.json: set aside, not removed
    assert len(kept) == 3 and kept[2].startswith("step_0000004.incomplete-")


def test_leftovers_are_removed_at_save(tmp_path):
    root, model, _ = leftovers(tmp_path)
    save_checkpoint(tmp_path, 5, model, None, PC, {"step": 5})
    kept = sorted(d.name for d in root.iterdir())
    assert [k for k in kept if ".incomplete-" not in k] == ["step_0000001", "step_0000002", "step_0000005"]
    assert [k for k in kept if ".incomplete-" in k][0].startswith("step_0000004.incomplete-")
    assert remove_leftovers(tmp_path) == []


def test_full_disk_during_a_checkpoint_write_is_one_line_naming_the_file(stores, tmp_path, capsys, monkeypatch):
    """torch.save writing into a full disk: the OSError names the checkpoint file, and the CLI
    prints it as one line with exit status 2 (it was a 30-line traceback)."""
    import errno

    from doremi.commands.cli import main
    from tests.runs import config_path
    from trainer.checkpoint import checkpoint

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint, "open", lambda p, mode="r": Full(open(p, mode)), raising=False)
    cfg = config_path(stores, tmp_path / "run")
    assert main(["train", str(cfg), "--set", "train.steps=1"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]  # not the start lines
    assert len(err) == 1 and err[0].startswith("doremi train: error: ")
    assert "checkpoints/step_0000001" in err[0] and err[0].endswith(".pt: No space left on device")
    assert not list((tmp_path / "run" / "checkpoints").glob("step_0000001"))
