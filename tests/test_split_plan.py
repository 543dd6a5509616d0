"""The stage-split cost model and the memory planner: hand-computed formulas, the exactness of
the split search, and the Llama-3-70B plan at tp4 pp4 (experiments/notes/PLAN_70B.md)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, ParallelismConfig, load_config
from trainer.plan.cost_model import CostModel, bytes_per_param
from trainer.plan.memory import GIB, format_plan, gpu_param_precision, plan_memory
from trainer.plan.stage_split import min_max_split, split_counts, split_layers

TINY = ModelConfig(**PRESETS["tiny"])  # h 64, f 128, 4 heads, 2 kv heads, d 16, vocab 256, 2 layers
LLAMA70 = ModelConfig(**{k: v for k, v in PRESETS["llama3-70b"].items() if k != "rope_scaling"})


def test_layer_activation_bytes_by_hand():
    cm = CostModel(TINY, tp=2, micro_batch_size=2, seq_len=16, sequence_parallel=True, recompute_allgather=True)
    # per token: norms 2(2*64+4)/2 + linear inputs 2*2*64/2 + qkv 2(64+2*32)/2 + attn out 2*64/2
    #            + lse 4*4/2 + swiglu 3*2*128/2 = 132 + 128 + 128 + 64 + 8 + 384 = 844
    assert cm.layer_activation_bytes("none") == 844 * 32
    assert cm.layer_activation_bytes("selective") == 836 * 32
    assert cm.layer_activation_bytes("full") == 64 * 32
    # without the recomputed all-gather the two column-linear inputs are saved whole: +2*2*64/2
    gathered = CostModel(TINY, tp=2, micro_batch_size=2, seq_len=16, sequence_parallel=True)
    assert gathered.layer_activation_bytes("none") == (844 + 128) * 32


def test_compiled_block_and_fused_head_by_hand():
    """Compiled at tp = 1 (the terms measured on an H200 for bench-1b, experiments/notes/PERFORMANCE.md)."""
    model = ModelConfig(**{**PRESETS["tiny"], "compile": True})
    cm = CostModel.from_config(model, ParallelismConfig(), micro_batch_size=2, seq_len=16)
    assert cm.compiled and cm.fused_loss
    # h 64, g d 32, f 128, 4 heads: none 2(6*64 + 2*32 + 3*128) + 16 + 8, selective 2(5*64 + 2*32 + 3*128) + 8
    assert cm.layer_activation_bytes("none") == (1664 + 24) * 32
    assert cm.layer_activation_bytes("selective") == 1544 * 32
    assert cm.layer_activation_bytes("full") == 128 * 32
    # head: bf16 final-norm input and logits, rstd, log-sum-exp and the loss in fp32
    assert cm.head_activation_bytes() == (2 * (64 + 256) + 12) * 32
    assert cm.head_transient_bytes() == 2 * 256 * 32
    tp2 = CostModel.from_config(model, ParallelismConfig(tp=2), micro_batch_size=2, seq_len=16)
    assert tp2.compiled and not tp2.fused_loss
    assert tp2.layer_activation_bytes("none") == CostModel(
        TINY, tp=2, micro_batch_size=2, seq_len=16
    ).layer_activation_bytes("none")


def test_llama70b_block_is_about_korthikanti_34sbh():
    cm = CostModel(LLAMA70, micro_batch_size=1, seq_len=1)
    # 12 h + 4 g d + 6 f + 4 a + 8 per token at tp = 1
    assert cm.layer_activation_bytes("none") == 12 * 8192 + 4 * 1024 + 6 * 28672 + 4 * 64 + 8
    assert cm.layer_activation_bytes("none") / 8192 == pytest.approx(33.53, abs=0.01)


def test_params_and_flops_by_hand():
    cm = CostModel(TINY, tp=2, pp=2, micro_batch_size=2, seq_len=16, recompute="selective")
    matmul = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # 36864
    assert cm.block_matmul_params() == matmul
    assert cm.block_params() == matmul // 2 + 2 * 64
    assert cm.stage_params(0, 1) == matmul // 2 + 128 + 128 * 64
    assert cm.stage_params(1, 1) == matmul // 2 + 128 + 128 * 64 + 64
    fwd = 2 * 32 * matmul / 2 + 2 * 32 * 16 * 64 / 2
    assert cm.block_flops() == 3 * fwd + 2 * 32 * 16 * 64 / 2
    assert cm.head_flops() == 6 * 32 * 64 * 128


def test_bytes_per_param():
    fp32 = bytes_per_param("fp32", dp=4, zero1=True)
    assert (fp32.weight, fp32.grad, fp32.optimizer, fp32.cast) == (4, 4, 2, 2)
    # bf16: the fp32 master is the parameter plus a 2-byte remainder; fp32 moments.
    assert bytes_per_param("bf16", dp=4, zero1=True).total == 2 + 4 + 10 / 4
    assert bytes_per_param("bf16", dp=4, zero1=False).total == 16
    assert bytes_per_param("bf16", dp=1, zero1=True, summed_grads=False).total == 2 + 0 + 10


@pytest.mark.parametrize("micro_batches,dp,grad_bytes", [(1, 1, 0), (2, 1, 4), (1, 2, 4)])
def test_bf16_grads_are_persistent_fp32_main_grads_only_when_summed(micro_batches, dp, grad_bytes):
    """What the optimizer allocates, the plan counts: fp32 main grads when the step sums
    gradients; otherwise none, and the head's bf16 `.grad` in the last stage's transient."""
    import torch

    from trainer.config.schema import TrainConfig
    from trainer.optim.master_weights import MasterWeightAdamW
    from trainer.parallel.context import ParallelContext

    cm = CostModel(model=TINY, dp=dp, micro_batches=micro_batches, param_precision="bf16")
    mem = cm.stage_memory(0, 2)
    assert mem.grads == mem.params * grad_bytes
    head_grad = 2 * cm.local_vocab * TINY.d_model
    assert mem.transient == cm.head_transient_bytes() + (head_grad if grad_bytes == 0 else 0)
    if dp == 1:
        named = [("w", torch.nn.Parameter(torch.randn(3, 4)))]
        opt = MasterWeightAdamW(named, TrainConfig(micro_batches=micro_batches), ParallelContext.single())
        assert (opt.main_grad is None) == (grad_bytes == 0)
        assert grad_bytes == 0 or opt.main_grad.dtype == torch.float32
        state = (opt.remainder, opt.exp_avg, opt.exp_avg_sq)
        assert sum(t.element_size() for t in state) == mem.optimizer / mem.params
        assert opt.flat_params.element_size() == mem.weights / mem.params
    with pytest.raises(ValueError, match="param_precision: expected one of fp32, bf16, got 'fp8'"):
        bytes_per_param("fp8", 1, True)


def test_in_flight_by_schedule():
    cm = CostModel(TINY, pp=4, micro_batches=8)
    assert [cm.in_flight(p) for p in range(4)] == [4, 3, 2, 1]
    afab = CostModel(TINY, pp=4, micro_batches=8, schedule="afab")
    assert [afab.in_flight(p) for p in range(4)] == [8, 8, 8, 8]


def test_min_max_split_is_exact():
    rng = random.Random(0)
    for _ in range(30):
        n, stages = rng.randint(3, 9), rng.randint(1, 3)
        stages = min(stages, n)
        weights = [[rng.random() for _ in range(n + 1)] for _ in range(stages)]

        def cost(p, k):
            return k * weights[p][1] + weights[p][0]

        got = min_max_split(n, stages, cost)
        assert sum(got) == n and min(got) >= 1
        brute = min(
            max(cost(p, k) for p, k in enumerate(c))
            for c in itertools.product(range(1, n + 1), repeat=stages)
            if sum(c) == n
        )
        assert max(cost(p, k) for p, k in enumerate(got)) == pytest.approx(brute, rel=1e-12)


def test_explicit_layers_win_and_are_checked():
    par = ParallelismConfig(pp=2, pp_layers=[3, 1])
    model = ModelConfig(n_layers=4)
    assert split_layers(model, par, 1, 16) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match=r"pp_layers: expected positive entries summing to .*=4, got \[4, 0\]"):
        split_layers(model, ParallelismConfig(pp=2, pp_layers=[4, 0]), 1, 16)
    with pytest.raises(ValueError, match="split policy: expected one of memory, compute, got 'greedy'"):
        split_layers(model, ParallelismConfig(pp=2), 1, 16, policy="greedy")


def test_compute_split_balances_and_memory_split_unloads_first_stage():
    par = ParallelismConfig(tp=4, pp=4, sequence_parallel=True, recompute="selective", tp_recompute_allgather=True)
    compute = split_layers(LLAMA70, par, 1, 8192, micro_batches=64, policy="compute")
    memory = split_layers(LLAMA70, par, 1, 8192, micro_batches=64)
    assert [len(r) for r in compute] == [20, 20, 21, 19]  # the head costs about 1.1 blocks
    assert [len(r) for r in memory] == [18, 20, 21, 21]
    assert memory[0] == range(0, 18) and memory[-1] == range(59, 80)
    cm = CostModel.from_config(LLAMA70, par, 1, 8192, 64)
    assert split_counts(cm, memory_weight=0.0) == [20, 20, 21, 19]


ROOT = Path(__file__).resolve().parents[1]


def _llama70b_config(dp: int = 1):
    """experiments/configs/llama3_70b.yaml (tp4 pp4, seq 8192, micro-batch 1, 64 micro-batches per dp
    rank, sequence parallel) with selective recompute (it ships with full recompute, which fits),
    optionally with more data-parallel ranks."""
    return load_config(
        ROOT / "experiments" / "configs" / "llama3_70b.yaml",
        [f"parallelism.dp={dp}", f"train.global_batch_size={64 * dp}", "parallelism.recompute=selective"],
    )


@pytest.mark.parametrize("precision,memory_peak,compute_peak", [("bf16", 99.2, 109.8), ("fp32", 106.9, 118.3)])
def test_llama70b_plan_tp4_pp4_on_16_gpus_of_96gb(precision, memory_peak, compute_peak):
    """The numbers of experiments/notes/PLAN_70B.md: bf16 parameters are what `doremi plan` plans on
    GPUs by default (`gpu_param_precision`)."""
    cfg = _llama70b_config()
    assert gpu_param_precision(cfg) == "bf16"
    memory = plan_memory(cfg, 16, 96, param_precision=precision)
    compute = plan_memory(cfg, 16, 96, split="compute", param_precision=precision)
    first_mem, first_cmp = memory.stages[0].memory, compute.stages[0].memory
    assert first_mem.total < first_cmp.total
    assert memory.peak_bytes < compute.peak_bytes
    assert first_mem.total / GIB == pytest.approx(memory_peak, abs=0.05)
    assert first_cmp.total / GIB == pytest.approx(compute_peak, abs=0.05)
    assert [s.memory.in_flight for s in memory.stages] == [4, 3, 2, 1]
    assert first_mem.params == 18 * 213_925_888 + 32_064 * 8192
    assert memory.layer_activation_bytes / 2**20 == pytest.approx(536.0, abs=0.1)
    assert not memory.fits and memory.peak_stage == 0  # 16 B/param (18 with fp32 params) at dp = 1 is too much
    table = format_plan(memory)
    assert "  0   0-17 (18)" in table and f"{memory_peak}" in table and "does NOT fit" in table


def test_memory_split_fits_where_compute_split_ooms_at_dp2():
    """The seed thread's case: tp4 pp4 with dp > 1 OOMs on the first stage under a compute split."""
    cfg = _llama70b_config(dp=2)
    memory = plan_memory(cfg, 32, 96, param_precision="bf16")
    compute = plan_memory(cfg, 32, 96, split="compute", param_precision="bf16")
    assert memory.fits and not compute.fits and compute.peak_stage == 0


def test_plan_rejects_wrong_gpu_count():
    cfg = _llama70b_config()
    with pytest.raises(
        ValueError, match=r"--gpus: expected a positive multiple of parallelism.tp x parallelism.pp = 4 x 4 = 16, got 8"
    ):
        plan_memory(cfg, 8, 96)
    with pytest.raises(ValueError, match="--gpu-memory: expected a positive number of GiB, got 0"):
        plan_memory(cfg, 16, 0)


PLANNED_LAYOUTS = [
    (
        "pile_280m.yaml",
        [
            "model.preset=doremi-760m",
            "train.optimizer=adamw",
            "parallelism.pp=8",
            "parallelism.dp=8",
            "train.micro_batches=8",
            "train.global_batch_size=256",
        ],
    ),
    (
        "pile_280m.yaml",
        [
            "train.optimizer=adamw",
            "parallelism.pp=4",
            "parallelism.dp=2",
            "train.micro_batches=4",
            "train.global_batch_size=64",
            "parallelism.pp_schedule=1f1b",
        ],
    ),
    (
        "pile_280m.yaml",
        [
            "train.optimizer=adamw",
            "parallelism.pp=4",
            "train.micro_batches=8",
            "parallelism.pp_schedule=afab",
            "parallelism.recompute=full",
        ],
    ),
    ("pile_280m.yaml", ["parallelism.pp=2", "train.optimizer=adafactor"]),
    ("llama3_70b.yaml", ["parallelism.dp=2", "train.global_batch_size=128"]),
]


@pytest.mark.parametrize("name,sets", PLANNED_LAYOUTS)
def test_doremi_plan_predicts_the_split_the_trainer_builds(name, sets):
    """`doremi plan` plans the GPU run's split: the same cost model, the same micro-batches in
    flight and the parameter precision the trainer resolves on CUDA."""
    import torch

    from doremi.config import ExperimentConfig
    from trainer.build import stage_layers
    from trainer.plan.memory import gpu_param_precision

    cfg = load_config(ROOT / "experiments" / "configs" / name, sets, cls=ExperimentConfig)
    plan = plan_memory(cfg, cfg.parallelism.world_size, 80.0, param_precision=gpu_param_precision(cfg))
    assert [s.layers for s in plan.stages] == stage_layers(cfg, torch.device("cuda"))
