"""Mixture-of-experts blocks and expert parallelism (issue 24; trainer/model/moe.py,
trainer/parallel/expert.py).

- The dropless grouped path equals a per-token, per-expert reference loop on the same tokens:
  forward and gradients, with and without the balance and z-losses (fp32, 1e-5).
- Routing and the balance loss on hand-computed cases; the all-to-all regrouping permutation.
- Bad layouts are one-line ConfigErrors: experts not divisible by ep, top_k > experts, ep not
  dividing dp.
- The trainer with MoE blocks (4 experts, top-2, one shared expert, blocks 1 and 3) under ep2,
  ep2 x tp2 (sequence parallel), ep2 x pp2, ep2 x dp4 (ZeRO-1 over the expert replicas), and at
  ep = 1 under tp2 + sequence parallel and pp2, equals one process: per-step losses, the logged
  balance loss and expert token counts, the validation losses (evaluation pads the dp ranks
  with fewer batches under ep), and the parameters after 3 steps (1e-5). A checkpoint
  written at ep2 resumes at ep1 (one process) and ep4 and continues as the uninterrupted run.
  DoReMi's alpha_t under ep2 x tp2 equals one process (1e-6).
Worlds of 2 and 4 gloo processes: one spawn each.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.compare_runs import COMPARED, assert_same_alphas, assert_same_params
from tests.distributed import spawn, world_size
from tests.runs import alphas, config, final_params, losses, run_stage, single_process_runs, val_losses
from trainer.config.moe import MoEConfig
from trainer.config.schema import ModelConfig
from trainer.config.tools import ConfigError
from trainer.model.moe import (
    MoE,
    balance_loss_per_sequence,
    grouped_swiglu,
    route,
    sequence_balance_terms,
)
from trainer.parallel.expert import regroup_by_expert
from trainer.parallel.tensor import TensorParallel
from trainer.records.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

# -- the block against a reference loop --------------------------------------------------------


def _moe(gating: str = "softmax", aux: float = 0.0, z: float = 0.0, shared: int = 0, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoEConfig(num_experts=4, top_k=2, gating=gating, aux_loss_coef=aux, z_loss_coef=z, shared_experts=shared)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, moe=moe)
    m = MoE(cfg, TensorParallel())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts one at a time, and the auxiliary losses written out."""
    cfg = m.moe
    s, b, d = x.shape
    logits = (x @ m.router.weight.t()).float()
    if cfg.gating == "softmax":
        probs = logits.softmax(-1)
        score = probs
    else:
        score = logits.sigmoid()
        probs = score / score.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    counts = torch.zeros(b, cfg.num_experts)
    for i in range(s):
        for j in range(b):
            top, idx = score[i, j].topk(cfg.top_k)
            w = top / top.sum()
            for slot in range(cfg.top_k):
                e = int(idx[slot])
                counts[j, e] += 1
                h = m.experts.gate_up[e] @ x[i, j]
                gate, up = h.chunk(2)
                y[i, j] = y[i, j] + w[slot] * (m.experts.down[e] @ (torch.nn.functional.silu(gate) * up))
    if m.shared is not None:
        h = x @ m.shared["gate_up"].weight.t()
        gate, up = h.chunk(2, dim=-1)
        y = y + (torch.nn.functional.silu(gate) * up) @ m.shared["down"].weight.t()
    n = m.global_sequences
    f = counts / (cfg.top_k * s)
    balance = (cfg.num_experts * (f * probs.mean(0)).sum(-1)).sum()
    z = torch.logsumexp(logits, -1).square().sum()
    aux = cfg.aux_loss_coef / n * balance + cfg.z_loss_coef / (n * s) * z
    return y, aux


@pytest.mark.parametrize(
    "gating,aux,z,shared", [("softmax", 0.0, 0.0, 0), ("softmax", 0.5, 0.1, 1), ("sigmoid", 0.5, 0.1, 0)]
)
def test_dropless_grouped_path_equals_per_expert_loop(gating, aux, z, shared):
    m = _moe(gating, aux, z, shared)
    m.global_sequences = 6
    x = torch.randn(16, 3, 32, requires_grad=True)
    r = torch.randn(16, 3, 32)
    (m(x) * r).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    y, loss_aux = _reference(m, x)
    ((y * r).sum() + loss_aux).backward()
    want = [x.grad] + [p.grad for p in m.parameters()]
    torch.testing.assert_close(m(x).detach(), y.detach(), rtol=1e-5, atol=1e-5)
    for (name, _), g, w in zip([("x", None), *m.named_parameters()], got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert m.stats_tokens.sum() == 2 * 16 * 3 * 2  # k x tokens x the two forwards with grad


def test_grouped_swiglu_skips_empty_experts():
    gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
    x = torch.randn(5, 4)
    out = grouped_swiglu(x, gate_up, down, [2, 0, 3])
    h = x[2:] @ gate_up[2].t()
    want = (torch.nn.functional.silu(h[:, :4]) * h[:, 4:]) @ down[2].t()
    torch.testing.assert_close(out[2:], want)


def test_routing_and_balance_loss_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]))
    r = route(logits, 2, "softmax", normalize_top_k=True)
    assert r.experts.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.625, 0.375], [0.7 / 0.9, 0.2 / 0.9]]))
    unnormalised = route(logits, 2, "softmax", normalize_top_k=False)
    torch.testing.assert_close(unnormalised.weights, torch.tensor([[0.5, 0.3], [0.7, 0.2]]))
    sig = route(torch.tensor([[0.0, 2.0, -1.0]]), 1, "sigmoid")
    assert sig.experts.tolist() == [[1]] and sig.weights.tolist() == [[1.0]]
    # One sequence of S=2 tokens, k=2: counts (1, 2, 1), mean probs (0.3, 0.25, 0.45).
    probs, counts = sequence_balance_terms(r.probs.view(2, 1, 3), r.experts.view(2, 1, 2), 3)
    assert counts.tolist() == [[1.0, 2.0, 1.0]]
    want = 3 * (0.25 * 0.3 + 0.5 * 0.25 + 0.25 * 0.45)
    assert balance_loss_per_sequence(probs, counts, 2, 2).item() == pytest.approx(want)
    # Uniform routing is the minimum, 1; everything on one expert with probability 1 gives E.
    uniform = balance_loss_per_sequence(torch.full((1, 4), 2.0), torch.full((1, 4), 1.0), 8, 0.5)
    assert uniform.item() == pytest.approx(1.0)
    assert balance_loss_per_sequence(torch.tensor([[8.0, 0, 0, 0]]), torch.tensor([[8.0, 0, 0, 0]]), 8, 1).item() == 4


def test_regroup_by_expert():
    # rows from source 0: e0 x1, e1 x2; from source 1: e0 x3 -> e0 (s0, s1), then e1 (s0)
    assert regroup_by_expert([[1, 2], [3, 0]]).tolist() == [0, 3, 4, 5, 1, 2]


@pytest.mark.parametrize(
    "sets,match",
    [
        (
            ["model.moe.num_experts=6", "parallelism.dp=4", "parallelism.ep=4"],
            "parallelism.ep: expected a divisor of model.moe.num_experts=6, got 4",
        ),
        (
            ["model.moe.num_experts=4", "model.moe.top_k=5"],
            "model.moe.top_k: expected 1 <= top_k <= num_experts=4, got 5",
        ),
        (
            ["model.moe.num_experts=4", "parallelism.dp=3", "parallelism.ep=2"],
            "parallelism.ep: expected a divisor of parallelism.dp=3, got 2",
        ),
        (["parallelism.dp=2", "parallelism.ep=2"], "parallelism.ep: expert parallelism needs model.moe"),
    ],
)
def test_bad_layouts_are_one_line_errors(tmp_path, sets, match):
    with pytest.raises(ConfigError, match=match) as err:
        config(tmp_path / "stores", tmp_path / "run", "train.global_batch_size=12", *sets)
    assert "\n" not in str(err.value)


# -- the trainer under expert-parallel layouts --------------------------------------------------

MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.layers=[1,3]",
    "model.moe.shared_experts=1",
    "model.moe.aux_loss_coef=0.1",
    "model.moe.z_loss_coef=0.01",
    *COMPARED,
    "train.eval_sequences=10",  # batches of a domain not a multiple of dp: evaluation pads under ep
]
EP2 = ["parallelism.dp=2", "parallelism.ep=2"]
LAYOUTS: dict[str, list[str]] = {
    "ep2": EP2,
    "tp2-sp": ["parallelism.tp=2", "parallelism.sequence_parallel=true"],
    "pp2-full": ["parallelism.pp=2", "train.micro_batches=2", "parallelism.recompute=full"],
    "ep2-tp2-sp": [*EP2, "parallelism.tp=2", "parallelism.sequence_parallel=true"],
    "ep2-pp2": [*EP2, "parallelism.pp=2", "train.micro_batches=2"],
    "ep2-dp4-zero1": ["parallelism.dp=4", "parallelism.ep=2", "parallelism.zero1=true"],
}
PROXY_TP = [*EP2, "parallelism.tp=2", "parallelism.sequence_parallel=true"]


def _moe_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "moe_balance_loss" in r]


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    proxy = single_process_runs(stores, root, MOE, [])
    jobs: dict[int, dict[str, list]] = {2: {"train": []}, 4: {"train": []}}
    for name, sets in LAYOUTS.items():
        jobs[world_size(sets)]["train"].append((str(root / name), [*MOE, *sets]))
    jobs[2]["train"].append((str(root / "ckpt-ep2"), [*MOE, *EP2, "train.steps=2"]))
    jobs[4]["train-proxy"] = [(str(root / "proxy-ep2-tp2"), [*proxy, *PROXY_TP])]
    spawn(run_stage, 2, "train", str(stores), jobs[2]["train"])
    for name in ("resume-ep1", "resume-ep4"):
        shutil.copytree(root / "ckpt-ep2", root / name)
    stages.train(config(stores, root / "resume-ep1", *MOE, "train.steps=4"))
    jobs[4]["train"].append((str(root / "resume-ep4"), [*MOE, "parallelism.dp=4", "parallelism.ep=4", "train.steps=4"]))
    spawn(_run_both, 4, str(stores), jobs[4])
    return root


def _run_both(rank: int, world: int, store: str, jobs: dict[str, list]) -> None:
    for stage, stage_jobs in jobs.items():
        run_stage(rank, world, stage, store, stage_jobs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(runs, stores, name):
    assert losses(runs / name) == pytest.approx(losses(runs / "single"), rel=1e-5)
    assert val_losses(runs / name) == pytest.approx(val_losses(runs / "single"), rel=1e-5)
    norms = [[r["grad_norm"] for r in read_jsonl(runs / n / "metrics.jsonl") if "loss" in r] for n in (name, "single")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and max(norms[1]) > 1.0  # clipped: each expert counted once
    got_rows, want_rows = _moe_rows(runs / name), _moe_rows(runs / "single")
    assert len(got_rows) == len(want_rows) == 3
    for got, want in zip(got_rows, want_rows):
        assert got["moe_balance_loss"] == pytest.approx(want["moe_balance_loss"], rel=1e-5)
        assert got["moe_z_loss"] == pytest.approx(want["moe_z_loss"], rel=1e-5)
        assert got["moe_expert_tokens"] == want["moe_expert_tokens"]
        assert sum(want["moe_expert_tokens"]["1"]) == 2 * 8 * 32  # k x sequences x seq_len
    want, got = final_params(stores, runs / "single", *MOE), final_params(stores, runs / name, *MOE)
    assert any("experts.gate_up" in p for p in want)
    assert_same_params(got, want)


@pytest.mark.parametrize("name", ["resume-ep1", "resume-ep4"])
def test_checkpoint_at_ep2_resumes_at_other_ep(runs, stores, name):
    assert losses(runs / name) == pytest.approx(losses(runs / "single-4steps"), rel=1e-5)
    want, got = final_params(stores, runs / "single-4steps", *MOE), final_params(stores, runs / name, *MOE)
    assert_same_params(got, want)


def test_doremi_weights_under_ep2_tp2_match_single_process(runs):
    assert_same_alphas(alphas(runs / "proxy-single"), alphas(runs / "proxy-ep2-tp2"), 3, moved=1e-4)


def test_plan_counts_experts_per_ep_rank_and_all_to_all_buffers():
    from trainer.config.presets import PRESETS
    from trainer.config.schema import ParallelismConfig
    from trainer.plan.moe import moe_stage_memory

    preset = dict(PRESETS["moe-1b-active"])
    cfg = ModelConfig(**{**preset, "moe": MoEConfig(**preset["moe"])})
    at = {ep: ParallelismConfig(dp=8, ep=ep, zero1=True) for ep in (1, 8)}
    one, eight = (moe_stage_memory(cfg, at[ep], range(20), 4, 2048, "bf16") for ep in (1, 8))
    per_expert = 3 * 2048 * 2048
    assert one.expert_params == 20 * 8 * per_expert and eight.expert_params == 20 * per_expert
    assert one.all_to_all == 0 and eight.all_to_all == 4 * (4 * 2048) * 2 * 2048 * 2.0  # send+recv x2, bf16
    # bf16: 2 B weight, 4 B main grad each; AdamW state over the dp (ep1) or replica (ep8: 1) group.
    delta = 20 * (8 * 2048 + per_expert - 3 * 2048 * 5632)
    assert eight.weights == pytest.approx(20 * per_expert * 2.0 + delta * 2.0)
    assert eight.optimizer == pytest.approx(20 * per_expert * 10.0 + delta * 10.0 / 8)
    assert one.optimizer == pytest.approx((20 * 8 * per_expert + delta) * 10.0 / 8)


def test_doge_under_expert_parallelism_is_refused_before_any_work(tmp_path):
    """DoGE's per-domain micro-batches differ between dp ranks; the experts' all-to-all needs
    every rank in every forward: one line, not a hang."""
    from doremi.methods.registry import preflight

    cfg = config(
        tmp_path / "stores",
        tmp_path / "run",
        "model.moe.num_experts=4",
        "parallelism.dp=2",
        "parallelism.ep=2",
        "mixing.method=doge",
    )
    with pytest.raises(ConfigError, match=r"^mixing.doge: DoGE's per-domain gradients do not run under expert"):
        preflight("doge", cfg, ["a", "b", "c"])
