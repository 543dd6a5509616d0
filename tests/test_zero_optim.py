"""Data parallelism (plain and ZeRO-1), the optimizers and gradient clipping against one process.

A toy stage follows the Llama stage contract: global parameter names (`embed.weight`,
`layers.<i>.…`, `norm.weight`, `head.weight`), tensor-parallel parameters cut from full tensors
by `shard()` and tagged with their ShardSpec (a vocab-parallel embedding and head, a fused
gate/up column-parallel weight, a row-parallel down weight, replicated norms), layers split
evenly over pipeline stages, and with tied embeddings the last stage holding a duplicate of
`embed.weight`. Every worker recomputes the single-process reference itself (same seeds).
"""

from __future__ import annotations

import functools
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import spawn
from trainer.config.schema import TrainConfig
from trainer.optim.build import build_optimizer
from trainer.optim.clip import clip_grad_norm
from trainer.optim.interface import OptimizerStateError
from trainer.parallel.context import ParallelContext
from trainer.parallel.data_parallel import partition_params
from trainer.parallel.shard import ShardSpec, set_shard_spec, shard

D, V, LAYERS = 16, 32, 4
BATCH, SEQ, MICRO = 8, 6, 2
LRS = (1e-2, 2e-2, 1.5e-2)
MAX_NORM = 0.05
CPU = torch.device("cpu")


# -- the toy stage ------------------------------------------------------------------------------


def toy_specs(tied: bool) -> dict[str, tuple[tuple[int, ...], ShardSpec | None]]:
    """Global name -> (full shape, ShardSpec) of the whole toy model."""
    s: dict[str, tuple[tuple[int, ...], ShardSpec | None]] = {"embed.weight": ((V, D), ShardSpec(0, (V,)))}
    for i in range(LAYERS):
        s[f"layers.{i}.norm.weight"] = ((D,), None)
        s[f"layers.{i}.up.weight"] = ((2 * D, D), ShardSpec(0, (D, D)))
        s[f"layers.{i}.down.weight"] = ((D, D), ShardSpec(1, (D,)))
    s["norm.weight"] = ((D,), None)
    if not tied:
        s["head.weight"] = ((V, D), ShardSpec(0, (V,)))
    return s


def full_tensors(specs: dict, seed: int) -> dict[str, torch.Tensor]:
    """Initial parameters: norms near 1, matrices N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, _) in specs.items():
        t = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.1 * t if name.endswith("norm.weight") else 0.2 * t
    return out


def stage_names(specs: dict, pp: int, pp_rank: int, tied: bool) -> list[str]:
    per = LAYERS // pp
    names = ["embed.weight"] if pp_rank == 0 else []
    for i in range(pp_rank * per, (pp_rank + 1) * per):
        names += [n for n in specs if n.startswith(f"layers.{i}.")]
    if pp_rank == pp - 1:
        names.append("norm.weight")
        names.append("embed.weight" if tied else "head.weight")
    return list(dict.fromkeys(names))


def build_stage(full: dict[str, torch.Tensor], specs: dict, names: list[str], tp: int, tp_rank: int) -> nn.Module:
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        spec = specs[name][1]
        p = nn.Parameter(shard(full[name], spec, tp_rank, tp).clone())
        set_shard_spec(p, spec)
        mod.register_parameter(leaf, p)
    return root


def toy_loss(params: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Sum over tokens of per-token cross entropy x `scale` (= 1 / global token count)."""
    x = params["embed.weight"][ids]
    for i in range(LAYERS):
        y = x * params[f"layers.{i}.norm.weight"]
        g, u = (y @ params[f"layers.{i}.up.weight"].T).chunk(2, dim=-1)
        x = x + (torch.tanh(g) * u) @ params[f"layers.{i}.down.weight"].T
    logits = (x * params["norm.weight"]) @ params.get("head.weight", params["embed.weight"]).T
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").sum() * scale


def toy_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def train_cfg(kind: str) -> TrainConfig:
    return TrainConfig(optimizer=kind, lr=LRS[0], weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


# -- the single-process reference ---------------------------------------------------------------


@functools.cache
def reference_run(kind: str, steps: int = len(LRS)) -> tuple[dict[str, torch.Tensor], list[float]]:
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.ndim >= 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, foreach=True)
    else:
        opt = torch.optim.Adafactor(groups, lr=LRS[0], foreach=True)
    norms = []
    for step in range(steps):
        ids, labels = toy_data(step)
        toy_loss(params, ids, labels, 1.0 / ids.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        for g in opt.param_groups:
            g["lr"] = LRS[step]
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}, norms


def dp_step(model: nn.Module, opt, pc: ParallelContext, step: int) -> torch.Tensor:
    """One step on this dp rank's rows, in MICRO micro-batches (gradients accumulate locally)."""
    params = dict(model.named_parameters())
    ids, labels = toy_data(step)
    rows = BATCH // pc.dp
    mine = slice(pc.dp_rank * rows, (pc.dp_rank + 1) * rows)
    for ids_mb, labels_mb in zip(ids[mine].chunk(MICRO), labels[mine].chunk(MICRO)):
        toy_loss(params, ids_mb, labels_mb, 1.0 / ids.numel()).backward()
    opt.reduce_gradients()
    norm = clip_grad_norm(list(model.named_parameters()), MAX_NORM, pc)
    opt.step(LRS[step])
    opt.zero_grad()
    return norm


def check_dp_parity(pc: ParallelContext, kind: str, zero1: bool) -> None:
    ref, ref_norms = reference_run(kind)
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    opt = build_optimizer(list(model.named_parameters()), train_cfg(kind), pc, zero1)
    for step in range(len(LRS)):
        norm = dp_step(model, opt, pc, step)
        assert ref_norms[step] > 2 * MAX_NORM
        assert float(norm) == pytest.approx(ref_norms[step], rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], rtol=0, atol=1e-6, msg=f"{kind} zero1={zero1} {name}")
        assert (p.detach() - full_tensors(specs, 0)[name]).abs().max() > 1e-3


def check_zero_partition(pc: ParallelContext, opt, names: list[str]) -> None:
    owned = opt.state_dict()["state"].keys()
    assert set(owned) == set(opt.owned_names())
    everyone: list = [None] * pc.dp
    dist.all_gather_object(everyone, sorted(owned), group=pc.dp_group)
    assert sorted(n for mine in everyone for n in mine) == sorted(names)
    assert all(mine for mine in everyone)


def check_resume(pc: ParallelContext, kind: str) -> None:
    """Run two steps, snapshot (serialised) model and optimizer state, run the third; a fresh
    model and optimizer loaded from the snapshot reproduce the third step bit for bit."""
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    opt = build_optimizer(list(model.named_parameters()), train_cfg(kind), pc, True)
    for step in range(2):
        dp_step(model, opt, pc, step)
    check_zero_partition(pc, opt, list(specs))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    dp_step(model, opt, pc, 2)
    buf.seek(0)
    snap = torch.load(buf, weights_only=True)
    fresh = build_stage(full_tensors(specs, 1), specs, list(specs), 1, 0)
    fresh.load_state_dict(snap["model"])
    opt2 = build_optimizer(list(fresh.named_parameters()), train_cfg(kind), pc, True)
    opt2.load_state_dict(snap["optim"])
    dp_step(fresh, opt2, pc, 2)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def _dp_worker(rank: int, world: int, kinds: tuple[str, ...], clip_layout: tuple[int, int] | None) -> None:
    pc = ParallelContext.from_process_group(1, 1, world, CPU)
    for kind in kinds:
        for zero1 in (False, True):
            check_dp_parity(pc, kind, zero1)
    check_resume(pc, kinds[0])
    if clip_layout is not None:
        check_clip(*clip_layout)


def test_dp1_matches_single_process_adamw_and_adafactor():
    for kind in ("adamw", "adafactor"):
        for zero1 in (False, True):
            check_dp_parity(ParallelContext.single(), kind, zero1)


@pytest.mark.dist
def test_dp2_zero_on_off_adamw_adafactor_and_resume():
    spawn(_dp_worker, 2, ("adamw", "adafactor"), None)


@pytest.mark.dist
def test_dp4_zero_on_off_adamw_and_resume_then_clip_at_tp2_pp2_tied():
    """Also the clipping check below under (tp2, pp2), in the same four processes."""
    spawn(_dp_worker, 4, ("adamw",), (2, 2))


# -- clipping under tp / pp / tied embeddings ----------------------------------------------------


def full_grads(specs: dict, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in specs.items()}


def check_clip(tp: int, pp: int) -> None:
    """The global norm over tp shards, pp stages and a tied embedding equals the full model's."""
    pc = ParallelContext.from_process_group(tp, pp, dist.get_world_size() // (tp * pp), CPU)
    specs = toy_specs(tied=True)
    grads = full_grads(specs)
    total = torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()
    names = stage_names(specs, pp, pc.pp_rank, tied=True)
    model = build_stage(full_tensors(specs, 0), specs, names, tp, pc.tp_rank)
    named = list(model.named_parameters())
    for name, p in named:
        p.grad = shard(grads[name], specs[name][1], pc.tp_rank, tp).clone()
    norm = clip_grad_norm(named, 1.0, pc)
    assert float(norm) == pytest.approx(total, rel=1e-6)
    coef = 1.0 / (total + 1e-6)
    for name, p in named:
        want = shard(grads[name], specs[name][1], pc.tp_rank, tp) * coef
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=0, msg=name)
    assert float(clip_grad_norm(named, 0.0, pc)) == pytest.approx(1.0, rel=1e-6)


def test_clip_single_process_matches_torch():
    specs = toy_specs(tied=False)
    grads = full_grads(specs)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    twin = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        p.grad, q.grad = grads[name].clone(), grads[name].clone()
    norm = clip_grad_norm(list(model.named_parameters()), 0.5, ParallelContext.single())
    ref = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert float(norm) == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


# -- units ----------------------------------------------------------------------------------------


def test_partition_is_greedy_size_balanced():
    # sizes 10, 7, 5, 3, 3 largest first: 10 -> 0, 7 -> 1, 5 -> 1 (7 < 10), 3 -> 0 (10 < 12), 3 -> 1 (12 < 13)
    assert partition_params([3, 10, 5, 7, 3], 2) == [0, 0, 1, 1, 1]
    assert partition_params([4, 4, 4], 4) == [0, 1, 2]
    assert partition_params([], 3) == []


def test_weight_decay_only_on_matrices_and_fused_flag_on_cpu():
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    opt = build_optimizer(list(model.named_parameters()), train_cfg("adamw"), ParallelContext.single(), True)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(specs)
    assert decay["foreach"] and not decay["fused"]
    opt.set_lr(0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]


def test_load_state_dict_errors():
    specs = toy_specs(tied=False)
    model = build_stage(full_tensors(specs, 0), specs, list(specs), 1, 0)
    opt = build_optimizer(list(model.named_parameters()), train_cfg("adamw"), ParallelContext.single(), False)
    with pytest.raises(OptimizerStateError, match="'adafactor'"):
        opt.load_state_dict({"kind": "adafactor", "state": {}})
    with pytest.raises(OptimizerStateError, match="no entry for parameter 'embed.weight'"):
        opt.load_state_dict({"kind": "adamw", "state": {"norm.weight": {}}})
    state = {
        n: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 3), "exp_avg_sq": torch.zeros(3, 3)} for n in specs
    }
    with pytest.raises(OptimizerStateError, match="'exp_avg' of parameter 'embed.weight' has shape \\(3, 3\\)"):
        opt.load_state_dict({"kind": "adamw", "state": state})
