"""Corner cases of the MoE and Mamba-2 blocks, each pinned after it broke or nearly did:

- expert parallelism with a rank whose local experts receive no token: the forward, the input
  gradient, the experts' and the router's gradients equal one process, and both ranks run the
  same collectives (the idle rank's graph was cut at its empty experts, so its backward skipped
  the return all-to-all: a hang, or a wrong gradient);
- top_k = num_experts, one token, one sequence: the grouped path equals the per-expert loop;
- sigmoid gating with top_k = 1 is refused (every weight would be 1: the router never learns);
- Mamba-2 with bf16 parameters: the chunked scan computes in fp32 (it crashed on the dtype mix of
  bf16 x, B, C with fp32 dt, A), also under autocast, and a hybrid trains with bf16 parameters;
- a MoE run saved at ep=2 (dp=2) resumed at ep=1 (dp=2), and a hybrid saved at tp=2 resumed at
  tp=1, continue as the uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from doremi.pipeline import stages
from tests.distributed import spawn
from tests.runs import config, losses, run_stage
from tests.test_moe import _reference
from trainer.config.moe import MoEConfig
from trainer.config.schema import ModelConfig
from trainer.config.tools import ConfigError
from trainer.model.mamba.ssd import ssd_chunked, ssd_reference
from trainer.model.moe import MoE
from trainer.parallel.expert import ExpertParallel
from trainer.parallel.tensor import TensorParallel

pytestmark = pytest.mark.usefixtures("one_thread")


def _moe_cfg(num_experts: int, top_k: int, gating: str = "softmax") -> ModelConfig:
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, gating=gating, aux_loss_coef=0.3, z_loss_coef=0.1)
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, moe=moe)


def _moe(num_experts: int, top_k: int, gating: str = "softmax") -> MoE:
    torch.manual_seed(0)
    m = MoE(_moe_cfg(num_experts, top_k, gating), TensorParallel())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def _grads(m: MoE, x: torch.Tensor, r: torch.Tensor, reference: bool) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    m.zero_grad()
    if reference:
        y, aux = _reference(m, x)
        ((y * r).sum() + aux).backward()
    else:
        (m(x) * r).sum().backward()
    return [x.grad, *(p.grad.clone() for p in m.parameters())]


# -- MoE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_experts,top_k,gating,shape",
    [(4, 4, "softmax", (5, 2)), (3, 3, "sigmoid", (5, 2)), (4, 2, "softmax", (1, 1)), (2, 2, "softmax", (3, 1))],
    ids=["topk-all-softmax", "topk-all-sigmoid", "one-token", "batch-1"],
)
def test_moe_corner_shapes_equal_the_per_expert_loop(num_experts, top_k, gating, shape):
    m = _moe(num_experts, top_k, gating)
    m.global_sequences = 3
    gen = torch.Generator().manual_seed(1)
    x, r = torch.randn(*shape, 32, generator=gen), torch.randn(*shape, 32, generator=gen)
    got, want = _grads(m, x, r, reference=False), _grads(m, x, r, reference=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert m.stats_tokens.sum() == top_k * shape[0] * shape[1]


def test_sigmoid_top_1_is_refused():
    with pytest.raises(ConfigError, match=r"^model.moe.top_k: sigmoid gating rescales .* expected top_k >= 2"):
        MoEConfig(num_experts=4, top_k=1, gating="sigmoid").validate()
    MoEConfig(num_experts=4, top_k=1, gating="softmax").validate()


def _idle_rank_worker(rank: int, world: int) -> None:
    """Rank 1 holds experts 2 and 3, which no token of either rank chooses."""
    import torch.distributed as dist

    m = _moe(4, 2)
    with torch.no_grad():
        m.router.weight[2:] = -1.0  # inputs are positive: experts 2, 3 score lowest everywhere
    m.global_sequences = 2
    gen = torch.Generator().manual_seed(2)
    x, r = torch.randn(6, 2, 32, generator=gen).abs(), torch.randn(6, 2, 32, generator=gen)
    want = _grads(m, x, r, reference=False)
    y_want = m(x).detach()
    assert m.stats_tokens[2:].sum() == 0

    ep = ExpertParallel(size=2, rank=rank, group=dist.group.WORLD, replica_ranks=[rank])
    e = MoE(_moe_cfg(4, 2), TensorParallel(), ep)
    e.global_sequences = 2
    with torch.no_grad():
        e.router.weight.copy_(m.router.weight)
        e.experts.gate_up.copy_(m.experts.gate_up.chunk(2)[rank])
        e.experts.down.copy_(m.experts.down.chunk(2)[rank])
    mine = slice(rank, rank + 1)
    xl = x[:, mine].clone().requires_grad_()
    y = e(xl)
    (y * r[:, mine]).sum().backward()
    torch.testing.assert_close(y, y_want[:, mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xl.grad, want[0][:, mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e.experts.gate_up.grad, want[2].chunk(2)[rank], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e.experts.down.grad, want[3].chunk(2)[rank], rtol=1e-5, atol=1e-5)
    router = e.router.weight.grad.clone()
    dist.all_reduce(router)
    torch.testing.assert_close(router, want[1], rtol=1e-5, atol=1e-5)
    if rank == 1:
        assert e.experts.gate_up.grad.abs().sum() == 0


def test_expert_parallel_rank_with_idle_experts_matches_one_process():
    spawn(_idle_rank_worker, 2)


# -- Mamba-2 in bf16 --------------------------------------------------------------------------------


def test_chunked_scan_computes_in_fp32_from_bf16_inputs_and_under_autocast():
    gen = torch.Generator().manual_seed(0)
    b, T, H, P, G, N = 1, 10, 4, 8, 2, 16
    x = torch.randn(b, T, H, P, generator=gen).bfloat16()
    dt = torch.nn.functional.softplus(torch.randn(b, T, H, generator=gen) - 1.0)
    A = -torch.rand(H, generator=gen) * 8 - 0.5
    B, C = (torch.randn(b, T, G, N, generator=gen).bfloat16() for _ in range(2))
    D = torch.randn(H, generator=gen).bfloat16()
    want = ssd_reference(x.float(), dt, A, B.float(), C.float(), D.float())
    got = ssd_chunked(x, dt, A, B, C, D, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = ssd_chunked(x.float(), dt, A, B.float(), C.float(), D.float(), 4)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, want, rtol=1e-5, atol=1e-5)


# -- resharded resumes ----------------------------------------------------------------------------

HYBRID = ["model.preset=hybrid-tiny", "model.mamba.chunk_size=12", "train.warmup_steps=0", "train.decay=constant"]
MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.aux_loss_coef=0.1",
    "model.moe.z_loss_coef=0.01",
    "train.warmup_steps=0",
    "train.decay=constant",
]


def _params(stores: Path, run: Path, sets: list[str]) -> dict[str, torch.Tensor]:
    from trainer.build import build_model
    from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint
    from trainer.parallel.context import ParallelContext

    model = build_model(config(stores, Path(str(run) + "-load"), *sets), ParallelContext.single())
    load_checkpoint(latest_checkpoint(run), model, None, ParallelContext.single())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_moe_ep2_resumes_at_ep1_dp2_and_hybrid_tp2_at_tp1(stores, tmp_path):
    dp2 = ["parallelism.dp=2"]
    spawn(
        run_stage,
        2,
        "train",
        str(stores),
        [
            (str(tmp_path / "hy-tp2"), [*HYBRID, "parallelism.tp=2", "train.steps=2"]),
            (str(tmp_path / "moe-ep2"), [*MOE, *dp2, "parallelism.ep=2", "train.steps=2"]),
            (str(tmp_path / "moe-dp2"), [*MOE, *dp2, "train.steps=4"]),
        ],
    )
    shutil.copytree(tmp_path / "hy-tp2", tmp_path / "hy-resumed")
    shutil.copytree(tmp_path / "moe-ep2", tmp_path / "moe-resumed")
    stages.train(config(stores, tmp_path / "hy-single", *HYBRID, "train.steps=4"))
    stages.train(config(stores, tmp_path / "hy-resumed", *HYBRID, "train.steps=4"))
    spawn(run_stage, 2, "train", str(stores), [(str(tmp_path / "moe-resumed"), [*MOE, *dp2, "train.steps=4"])])
    for sets, want, got in [(HYBRID, "hy-single", "hy-resumed"), (MOE, "moe-dp2", "moe-resumed")]:
        assert len(losses(tmp_path / got)) == 4
        assert losses(tmp_path / got) == pytest.approx(losses(tmp_path / want), rel=1e-5)
        a, b = _params(stores, tmp_path / want, sets), _params(stores, tmp_path / got, sets)
        for name in a:
            # Adam's normalised step turns fp32 order differences in near-zero gradient elements
            # into parameter differences: 1.3e-5 seen on one CPU host, 0.5% of one step at lr 3e-3
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=5e-5, msg=name)


def test_grouped_experts_take_the_autocast_dtype(monkeypatch):
    """fp32 expert weights under bf16 autocast reach the grouped-GEMM check in bf16 (on CUDA:
    the grouped kernel, not the per-expert loop in fp32)."""
    import trainer.model.moe as moe

    seen: list[torch.dtype] = []
    monkeypatch.setattr(
        moe, "_grouped_mm_applies", lambda x, gu, d: seen.extend([x.dtype, gu.dtype, d.dtype]) and False
    )
    x, gate_up, down = torch.randn(6, 8), torch.randn(2, 32, 8), torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe.grouped_swiglu(x, gate_up, down, [4, 2])
    assert seen == [torch.bfloat16] * 3 and out.dtype == torch.bfloat16
    seen.clear()
    assert moe.grouped_swiglu(x, gate_up, down, [4, 2]).dtype == torch.float32 and seen == [torch.float32] * 3
