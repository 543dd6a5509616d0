"""The sharding plan (`trainer.model.sharding`, docs/design.md section 5): every parameter of
each model family is exactly one row, built as the row says; the process groups are made in
one place (`trainer.parallel.context`), and the checkpoint code holds no list of names."""

import ast
import re
from pathlib import Path

import pytest

from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, ParallelismConfig
from trainer.config.tools import from_dict
from trainer.model.llama import LlamaStage
from trainer.model.sharding import PLANS, on_stage, placement, plan_key
from trainer.parallel.context import ParallelContext, grid_groups
from trainer.parallel.expert import ExpertParallel, expert_parallel_of
from trainer.parallel.shard import get_shard_spec
from trainer.parallel.tensor import TensorParallel

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {
    "dense": ("tiny", {}),
    "moe": ("moe-tiny", {}),
    "mamba": ("hybrid-tiny", {}),
    "hybrid-moe-tied": ("hybrid-tiny", {"moe": {"num_experts": 4, "top_k": 2, "shared_experts": 1}}),
}


def _stages(family: str, tie: bool = False) -> list[LlamaStage]:
    """The family's model at tp = 2, ep = 2 as a first and a last pipeline stage."""
    preset, extra = FAMILIES[family]
    cfg = from_dict(ModelConfig, {**PRESETS[preset], **extra, "tie_embeddings": tie or "tied" in family})
    tp = TensorParallel.from_config(ParallelismConfig(tp=2), ParallelContext(tp=2, dp=2))
    ep = ExpertParallel(size=2)
    half = cfg.n_layers // 2
    return [
        LlamaStage(cfg, tp, range(0, half), True, False, ep=ep),
        LlamaStage(cfg, tp, range(half, cfg.n_layers), False, True, ep=ep),
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_parameter_is_one_row_built_as_the_row_says(family):
    for stage in _stages(family):
        for name, param in stage.named_parameters():
            assert sum(plan_key(name) in plan for plan in PLANS.values()) == 1, name
            row, spec = placement(name), get_shard_spec(param)
            assert (spec.dim if spec else None) == row.dim, name
            assert (expert_parallel_of(param) is not None) == row.ep, name


def test_every_row_is_used_by_its_family():
    names = {family: {plan_key(n) for s in _stages(family) for n, _ in s.named_parameters()} for family in FAMILIES}
    assert set(PLANS["dense"]) - {"head.weight"} <= names["dense"]
    assert "head.weight" in names["moe"]
    assert set(PLANS["moe"]) <= names["hybrid-moe-tied"]
    assert set(PLANS["mamba"]) <= names["mamba"]
    assert "mlp.experts.gate_up" not in names["dense"] | names["mamba"]


def test_pp_rules():
    assert [on_stage("embed.weight", tie, f, la) for tie in (False, True) for f, la in ((1, 0), (0, 1), (0, 0))] == [
        True, False, False, True, True, False,
    ]  # fmt: skip
    assert [on_stage("head.weight", tie, False, True) for tie in (False, True)] == [True, False]
    assert on_stage("norm.weight", False, True, False) is False
    assert on_stage("layers.3.mlp.experts.down", False, False, False) is True
    stages = _stages("dense", tie=True)
    assert ["embed.weight" in dict(s.named_parameters()) for s in stages] == [True, True]
    assert not any("head.weight" in dict(s.named_parameters()) for s in stages)


def test_a_name_outside_the_plan_is_refused():
    with pytest.raises(KeyError, match="'layers.0.attn.bias': 0 rows"):
        placement("layers.0.attn.bias")


def test_grid_groups():
    g = grid_groups(tp=2, pp=2, dp=4, ep=2)
    assert list(g) == ["tp", "dp", "pp", "tied", "ep", "ep_replica"]
    assert g["tp"][:2] == [[0, 1], [2, 3]]
    assert g["dp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["pp"][:2] == [[0, 8], [1, 9]]
    assert g["tied"] == g["pp"]
    assert g["ep"][:3] == [[0, 2], [4, 6], [1, 3]]
    assert g["ep_replica"][:3] == [[0, 4], [2, 6], [1, 5]]
    assert {k: len(v) for k, v in g.items()} == {"tp": 8, "dp": 4, "pp": 8, "tied": 8, "ep": 8, "ep_replica": 8}
    for kind in ("ep", "ep_replica"):
        assert sorted(r for ranks in g[kind] for r in ranks) == list(range(16))
    assert "ep" not in grid_groups(2, 1, 2) and grid_groups(1, 3, 1)["tied"] == [[0, 2]]


def test_process_groups_are_made_only_by_the_context():
    found = sorted(
        str(path.relative_to(ROOT))
        for top in ("data", "trainer", "doremi", "experiments")
        for path in (ROOT / top).rglob("*.py")
        if "new_group" in path.read_text()
    )
    assert found == ["trainer/parallel/context.py"]


def _string_constants(path: Path) -> list[str]:
    """The string literals of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_checkpoint_code_holds_no_list_of_parameter_names():
    pieces = {name for plan in PLANS.values() for key in plan for name in (key, key.removesuffix(".weight"))}
    word = re.compile(r"\b(" + "|".join(sorted(map(re.escape, pieces))) + r")\b")
    named = {
        f"{path.relative_to(ROOT)}: {s!r}"
        for path in [*(ROOT / "trainer/checkpoint").glob("*.py"), ROOT / "trainer/hf/init.py"]
        for s in _string_constants(path)
        if word.search(s)
    }
    assert named == set()
