"""One owner per format and concept (issue 19): the weights JSON, the reference cache, the stage
markers and the user errors each have one module, and no module imports itself back."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data import artifact
from data.errors import DataError, UserError
from data.sampling.weights_file import WEIGHTS_FILE, read_mixture_file, read_weights_file, write_weights_file
from doremi.commands.cli import main
from doremi.errors import DoReMiError
from doremi.methods.history import HistoryError, read_weights_json, write_weights_json
from doremi.methods.reference_cache import CACHE_VERSION, META_FILE, create_arrays, open_cache, publish, staging_dir
from doremi.outputs.stage_markers import (
    EVAL_OUTPUT,
    done_marker,
    eval_result,
    read_marker,
    started_marker,
    write_done,
    write_started,
)
from doremi.reports.guardrails import GuardrailError
from tests.runs import config_path
from trainer.checkpoint.checkpoint import CheckpointError
from trainer.config.schema import TrainConfig
from trainer.config.tools import ConfigError
from trainer.optim.interface import OptimizerStateError
from trainer.optim.master_weights import MasterWeightAdamW, MasterWeightStateError
from trainer.parallel.context import ParallelContext

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["web", "code", "books"]


# -- the weights JSON ------------------------------------------------------------------------------


def test_weights_file_bytes_and_both_readers(tmp_path):
    path = tmp_path / WEIGHTS_FILE
    provenance = {"source": "runs/proxy", "from_step": 1, "created": "2024-01-01T00:00:00+00:00"}
    write_weights_file(path, DOMAINS, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), provenance)
    doc = {"domains": DOMAINS, "weights": [0.5, 0.25, 0.25], **provenance}
    header = artifact.Header("weights", fingerprint=artifact.content_hash({k: doc[k] for k in ("domains", "weights")}))
    doc = artifact.embed(doc, header)  # its artifact header (docs/design.md section 6b)
    assert path.read_text() == json.dumps(doc, indent=2) + "\n"
    assert read_weights_file(path) == doc
    assert read_mixture_file(path, "data.domain_weights") == (DOMAINS, [0.5, 0.25, 0.25])
    again = tmp_path / "again.json"
    write_weights_json(again, DOMAINS, np.array([0.5, 0.25, 0.25]), provenance)
    assert again.read_bytes() == path.read_bytes()  # the package API writes through the owner


def test_weights_file_errors_keep_each_callers_class(tmp_path):
    path = tmp_path / WEIGHTS_FILE
    with pytest.raises(DataError, match="summing to 1"):
        write_weights_file(path, DOMAINS, [0.5, 0.5, 0.5], {})
    with pytest.raises(HistoryError, match="summing to 1"):
        write_weights_json(path, DOMAINS, [0.5, 0.5, 0.5], {})
    with pytest.raises(HistoryError, match=f"{path}: weights file not found"):
        read_weights_json(path)
    with pytest.raises(DataError, match=f"^pipeline.baselines\\[0\\]: weights file {path} not found"):
        read_mixture_file(path, "pipeline.baselines[0]")
    path.write_text(json.dumps({"domains": ["a", "a"], "weights": [1, 1]}))
    with pytest.raises(DataError, match="a domain is named twice"):
        read_mixture_file(path, "data.domain_weights")


# -- the reference cache ---------------------------------------------------------------------------


def test_reference_cache_round_trip(tmp_path, monkeypatch):
    out = tmp_path / "cache"
    tmp = staging_dir(out)
    create_arrays(tmp, ["a", "b"], [3, 2], 4)
    stamp = {"reference": "runs/ref/checkpoints/step_0000003", "reference_fingerprint": "f" * 16}
    publish(tmp, out, ["a", "b"], 4, stamp, 5, 8, 0, [0.5, 0.5], [1, 2])
    assert not tmp.exists() and sorted(p.name for p in out.iterdir()) == ["a.npy", "b.npy", META_FILE]
    meta = json.loads((out / META_FILE).read_text())
    assert artifact.Header.from_json(meta.pop(artifact.HEADER_KEY), "meta").kind == "reference_cache"
    assert meta == (
        {
            "version": CACHE_VERSION,
            "domains": ["a", "b"],
            "seq_len": 4,
            **stamp,
            "steps": 5,
            "global_batch_size": 8,
            "seed": 0,
            "sampling": [0.5, 0.5],
            "sequences": [1, 2],
        }
    )
    with pytest.raises(
        DoReMiError, match="cannot verify the cache: its reference runs/ref/checkpoints/step_0000003 is gone"
    ):
        open_cache(out, ["a", "b"], 4, steps=5, global_batch_size=8, seed=0, sampling=[0.5, 0.5])
    monkeypatch.setattr("doremi.methods.reference_cache._check_recorded_reference", lambda *a: None)
    arrays = open_cache(out, ["a", "b"], 4, steps=5, global_batch_size=8, seed=0, sampling=[0.5, 0.5])
    assert [a.shape for a in arrays] == [(3, 4), (2, 4)] and all(np.isnan(a).all() for a in arrays)
    with pytest.raises(DoReMiError, match="cache covers 5 steps, fewer steps than the run's train.steps=6"):
        open_cache(out, ["a", "b"], 4, steps=6, global_batch_size=8, seed=0, sampling=[0.5, 0.5])


# -- stage markers ---------------------------------------------------------------------------------


def test_stage_markers(tmp_path):
    run = tmp_path / "main" / "uniform"
    assert done_marker(run) == run / "stage.json"
    assert done_marker(run / EVAL_OUTPUT) == run / "eval.json.stage.json"
    assert started_marker(done_marker(run / EVAL_OUTPUT)) == run / "eval.json.stage.started.json"
    run.mkdir(parents=True)
    marker = done_marker(run / EVAL_OUTPUT)
    write_started(marker, "eval: uniform", "abc")
    assert eval_result(run) is None and read_marker(started_marker(marker))["fingerprint"] == "abc"
    write_done(marker, "eval: uniform", "abc", {"domains": ["a"], "val_loss": [1.5]})
    assert marker.read_text() == json.dumps(
        {"stage": "eval: uniform", "fingerprint": "abc", "result": {"domains": ["a"], "val_loss": [1.5]}}
    )
    assert not started_marker(marker).exists()
    assert eval_result(run) == {"domains": ["a"], "val_loss": [1.5]}


# -- user errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [
        DataError,
        ConfigError,
        DoReMiError,
        GuardrailError,
        HistoryError,
        CheckpointError,
        OptimizerStateError,
        MasterWeightStateError,
    ],
)
def test_every_user_error_is_a_user_error_and_still_a_value_error(cls):
    assert issubclass(cls, UserError) and issubclass(cls, ValueError)


def test_bf16_optimizer_state_mismatch_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """A resume whose saved state does not fit the bf16 (master-weight) optimizer: the error the
    optimizer raises reaches the CLI as one line and status 2, not a traceback."""
    from doremi.pipeline import stages

    def resume_with_state_that_does_not_fit(cfg):
        params = [("a.weight", torch.nn.Parameter(torch.zeros(4, 3)))]
        opt = MasterWeightAdamW(params, TrainConfig(), ParallelContext.single())
        state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        opt.load_state_dict({"kind": "adamw", "state": {"a.weight": state}})

    monkeypatch.setattr(stages, "train", resume_with_state_that_does_not_fit)
    rc = main(["train", str(config_path(tmp_path / "stores", tmp_path / "run"))])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err == [
        "doremi train: error: optimizer state 'exp_avg' of parameter 'a.weight' has shape (3,), the parameter is (4, 3)"
    ]


# -- imports ---------------------------------------------------------------------------------------

#: Each package's rooms (folders, or top-level modules), lowest first: a module may import from
#: its own room and the rooms before it, never from one after it (docs/architecture.md). A
#: module belongs to the room of its longest matching prefix (a package, folder or module).
ROOMS: dict[str, list[tuple[str, ...]]] = {
    "data": [
        # the lowest layer: user errors, atomic writes, progress lines; the package itself (its
        # empty __init__.py, which `from data import artifact` names) and the corpus's build script
        ("data", "data.errors", "data.atomic", "data.progress"),
        # artifact headers (written atomically) and the `data` config section
        ("data.artifact", "data.config"),
        ("data.store",),
        # side by side on the stores: where documents come from, tokenizers, weights and sampling
        ("data.sources", "data.tokenizer", "data.sampling"),
        # `doremi preprocess`, which uses all of them
        ("data.preprocess",),
    ],
    "trainer": [
        ("trainer.config",),
        ("trainer.parallel",),
        ("trainer.model",),
        ("trainer.optim",),
        ("trainer.plan",),
        ("trainer.build",),
        ("trainer.checkpoint",),
        ("trainer.hf",),
        ("trainer.feed",),
        ("trainer.records",),
        ("trainer.run",),
        ("trainer.stacked",),
    ],
    "doremi": [
        ("doremi.errors", "doremi.environment"),
        # the offline fits' generic machinery, which the methods' own fits (regmix, mixing_law) build on
        ("doremi.offline.fit",),
        ("doremi.config", "doremi.methods"),
        ("doremi.outputs",),
        ("doremi.offline",),
        ("doremi.reports",),
        ("doremi.pipeline",),
        ("doremi.study",),
        ("doremi.commands", "doremi"),
    ],
}


def _nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        yield node
        yield from _nodes(node)


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at module level, in functions or for type
    checking only (a type-only circle is a circle to a reader)."""
    modules = {}
    for package in ("data", "trainer", "doremi"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in _nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_module_imports_itself_back():
    graph = _imports()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    circles = sorted(m for m in graph if m in reaches(m))
    assert circles == []


def _room(module: str) -> tuple[int, int]:
    """(layer of the package, rank of the module's room inside it)."""
    package = module.split(".")[0]
    rooms = ROOMS[package]
    matches = [
        (len(p), i) for i, prefixes in enumerate(rooms) for p in prefixes if module == p or module.startswith(p + ".")
    ]
    assert matches, f"{module}: in no room of ROOMS[{package!r}]"
    return list(ROOMS).index(package), max(matches)[1]


def test_layers_and_rooms_import_downwards_only():
    graph = _imports()
    upward = sorted((m, d) for m, deps in graph.items() for d in deps if _room(d) > _room(m))
    assert upward == []
