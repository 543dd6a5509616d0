"""bf16 parameters with fp32 master weights and main grads (train.param_dtype=bf16) in the trainer.

Single process: the trainer against torch.optim.AdamW on fp32 copies fed the trainer's own
(bf16-computed) gradients; micro-batch gradients accumulate in fp32, exactly. Over gloo
(one spawn of two processes): ZeRO-1 on and off, dp=2 against one process with 2 micro-batches,
tp=2 and pp=2 (tied embeddings) against one process, and resumes of bf16 checkpoints at other
layouts; then, in one process, a dp=2 ZeRO-1 checkpoint resumed at dp=1 and the fp32 <-> bf16
cross-loads.

Tolerances. dp changes nothing that bf16 computes: each micro-batch runs the same bf16 kernels
on the same rows and dp sums the fp32 main grads, so parameters match to fp32 rounding of the
master (the clip norm's partial sums are added in another order), and ZeRO-1 on and off are
bit-identical. tp and the tied embedding under pp do change bf16 rounding: a row-parallel
matmul rounds each rank's partial product to bf16 before the all-reduce, and the two uses of a
tied embedding are summed in fp32 main grads instead of in one bf16 gradient. Those are
relative errors of ~2^-8 in activations and gradients; Adam's normalised update turns a
near-zero gradient's rounding into up to one lr of parameter movement. So those layouts are
held to: losses within 2e-4 relative, gradient norms within 1e-2, no parameter further than
one lr (BF16_ATOL), and the L2 difference under 2% of the distance the parameters moved.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from data.store.batch import IGNORE_INDEX
from doremi.pipeline import stages
from tests.bf16 import rounded_half_away
from tests.distributed import spawn
from tests.runs import config, final_params, losses, run_stage
from trainer.build import autocast, build_model
from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config.tools import ConfigError
from trainer.optim.build import build_optimizer
from trainer.optim.lr_schedule import lr_at
from trainer.optim.master_weights import MasterWeightAdamW
from trainer.optim.sharded import ShardedOptimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import grad_of
from trainer.plan.memory import gpu_param_precision
from trainer.plan.resolve import param_dtype
from trainer.records.metrics import read_jsonl
from trainer.run.loop import Trainer

BF16 = ["train.precision=bf16", "train.param_dtype=bf16"]
FP32_PARAMS = ["train.precision=bf16", "train.param_dtype=fp32"]
# As in test_layouts: Adam's eps keeps rounding of near-zero gradients from being amplified to lr.
COMMON = [
    "train.eps=1e-4",
    "train.decay=constant",
    "train.warmup_steps=0",
    "checkpoint.keep=2",
    "train.steps=4",
    "train.micro_batches=2",
]
TIED = ["model.tie_embeddings=true"]
LR = 3e-3  # tests/runs.py
BF16_ATOL = LR  # no element further apart than one Adam step
BF16_REL = 0.02  # of the distance the parameters moved, in L2 (measured: 0.9% at tp2, 0.3% at pp2 tied)


def masters(stores: Path, run: Path, *sets: str) -> dict[str, torch.Tensor]:
    """The fp32 master of every parameter in a run's last checkpoint, read by a single-process
    fp32 model with its optimizer (so: from the checkpoint's master state, any saved layout)."""
    cfg = config(stores, Path(str(run) + "-masters"), "train.param_dtype=fp32", *sets)
    pc = ParallelContext.single()
    model = build_model(cfg, pc)
    named = list(model.named_parameters())
    load_checkpoint(latest_checkpoint(run), model, build_optimizer(named, cfg.train, pc, False), pc)
    return {n: p.detach().clone() for n, p in named}


def grad_norms(run: Path) -> list[float]:
    return [r["grad_norm"] for r in read_jsonl(run / "metrics.jsonl") if "grad_norm" in r]


def assert_params_close(got: dict, want: dict, atol: float, rtol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# -- single process ---------------------------------------------------------------------------


def test_param_dtype_resolution_and_config_errors(stores, tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = config(stores, tmp_path / "a")
    assert param_dtype(cfg, cpu) == torch.float32 and param_dtype(cfg, cuda) == torch.bfloat16
    assert param_dtype(config(stores, tmp_path / "b", "train.precision=bf16"), cpu) == torch.bfloat16
    assert param_dtype(config(stores, tmp_path / "c", "train.optimizer=adafactor"), cuda) == torch.float32
    assert param_dtype(config(stores, tmp_path / "d", "train.param_dtype=fp32"), cuda) == torch.float32
    assert gpu_param_precision(cfg) == "bf16"  # what `doremi plan` plans for
    assert gpu_param_precision(config(stores, tmp_path / "c", "train.optimizer=adafactor")) == "fp32"
    explicit = config(stores, tmp_path / "e", "train.param_dtype=bf16")
    # bf16 parameters compute in bf16 without autocast; fp32 parameters computing in bf16 use it.
    assert param_dtype(explicit, cpu) == torch.bfloat16 and not isinstance(autocast(explicit, cpu), torch.autocast)
    assert isinstance(autocast(config(stores, tmp_path / "f", *FP32_PARAMS), cpu), torch.autocast)
    for sets, want in [
        (
            ["train.param_dtype=bf16", "train.optimizer=adafactor"],
            "train.param_dtype: bf16 parameters keep fp32 master weights in AdamW only, got "
            "train.optimizer='adafactor' (use param_dtype fp32 or auto)",
        ),
        (
            ["train.param_dtype=bf16", "train.precision=fp32"],
            "train.param_dtype: bf16 parameters compute in bf16, got train.precision='fp32' (use precision bf16 or auto)",
        ),
        (["train.param_dtype=fp16"], "train.param_dtype: expected one of 'auto', 'fp32', 'bf16', got 'fp16' (str)"),
    ]:
        with pytest.raises(ConfigError) as e:
            config(stores, tmp_path / "bad", *sets)
        assert str(e.value).startswith(want) and "\n" not in str(e.value)


def test_trainer_matches_torch_adamw_on_fp32_copies(stores, tmp_path):
    """Three steps (clipping active) of the bf16 trainer: its fp32 master equals torch AdamW run
    on fp32 copies of the initial parameters with the trainer's gradients; the bf16 parameters
    are the master's rounding."""
    cfg = config(stores, tmp_path / "run", *BF16, "train.steps=3", "train.grad_clip=0.5")
    trainer = Trainer(cfg)
    opt = trainer.optimizer
    assert isinstance(opt, MasterWeightAdamW) and not opt.zero1
    # One micro-batch, one process: nothing sums gradients, so the update reads autograd's `.grad`.
    assert cfg.train.micro_batches == 1 and opt.main_grad is None
    params = dict(trainer.named_params)
    ref = {n: torch.nn.Parameter(m.clone()) for n, m in opt.master_weights().items()}
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref.values() if p.ndim >= 2], "weight_decay": cfg.train.weight_decay},
            {"params": [p for p in ref.values() if p.ndim < 2], "weight_decay": 0.0},
        ],
        betas=(cfg.train.beta1, cfg.train.beta2),
        eps=cfg.train.eps,
        foreach=False,
    )
    seen: list[dict[str, torch.Tensor]] = []
    clip = opt.clip_grad_norm

    def recording_clip(max_norm: float) -> torch.Tensor:
        seen.append({n: grad_of(p).float() for n, p in params.items()})
        return clip(max_norm)

    opt.clip_grad_norm = recording_clip
    norms = []
    for step in range(1, 4):
        stats, _ = trainer.train_step()
        for n, p in ref.items():
            p.grad = seen[-1][n]
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)))
        for g in ref_opt.param_groups:
            g["lr"] = lr_at(step, cfg.train)
        ref_opt.step()
        assert float(stats.grad_norm) == pytest.approx(norms[-1], rel=1e-6)
        master = opt.master_weights()
        for n, p in params.items():
            torch.testing.assert_close(master[n], ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), rounded_half_away(master[n])), n
    assert min(norms) > 0.5  # clipping was active
    assert all(p.grad is None for p in params.values())


def test_micro_batch_gradients_accumulate_in_fp32(stores, tmp_path):
    """Four micro-batches leave in the main grads exactly the fp32 sum of the four bf16
    gradients (each computed alone), where summing them in bf16 `.grad` is off by ~1e-3. The
    one-big-batch gradient (one bf16 rounding of the whole sum) agrees to bf16 precision."""
    trainer = Trainer(config(stores, tmp_path / "run", *BF16, "train.micro_batches=4"))
    params = dict(trainer.named_params)
    assert trainer.optimizer.main_grad.dtype == torch.float32
    batches = trainer.feed.step_batches(1, trainer.hook.sampling_weights(1))
    scale = 1.0 / sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)

    def backward(batch: dict) -> None:
        with trainer.autocast:
            losses = trainer.model(None, batch).float()
        (losses * (batch["labels"] != IGNORE_INDEX)).sum().mul(scale).backward()

    singles = []
    for b in batches:
        trainer.optimizer.zero_grad()
        backward(b)
        singles.append({n: p.main_grad.clone() for n, p in params.items()})
    trainer.optimizer.zero_grad()
    for b in batches:
        backward(b)
    bf16_err = 0.0
    for n, p in params.items():
        exact = singles[0][n] + singles[1][n] + singles[2][n] + singles[3][n]
        assert torch.equal(p.main_grad, exact), n
        in_bf16 = singles[0][n].bfloat16()
        for single in singles[1:]:
            in_bf16 += single[n].bfloat16()
        bf16_err = max(bf16_err, float((in_bf16.float() - exact).abs().max() / exact.abs().max()))
    assert bf16_err > 1e-3  # measured 5e-3
    trainer.optimizer.zero_grad()
    backward({k: torch.cat([b[k] for b in batches]) for k in batches[0] if isinstance(batches[0][k], torch.Tensor)})
    for n, p in params.items():
        exact = singles[0][n] + singles[1][n] + singles[2][n] + singles[3][n]
        assert float((p.main_grad - exact).abs().max() / exact.abs().max()) < 1e-2, n  # measured <= 5e-3


# -- layouts and checkpoints --------------------------------------------------------------------

WORLD2 = {
    "dp2-zero1": ["parallelism.dp=2", "parallelism.zero1=true", "train.micro_batches=1", "checkpoint.every=2"],
    "dp2-nozero": ["parallelism.dp=2", "parallelism.zero1=false", "train.micro_batches=1"],
    "tp2-sp": ["parallelism.tp=2", "parallelism.sequence_parallel=true"],
    "pp2-tied": ["parallelism.pp=2", *TIED],
    "resume-tp2": ["parallelism.tp=2"],
    "resume-pp2": ["parallelism.pp=2"],
}


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bf16")
    for name, sets in (
        ("single", BF16),
        ("single-tied", [*BF16, *TIED]),
        ("ckpt-single", [*BF16, "train.steps=2"]),
        ("fp32", FP32_PARAMS),
        ("ckpt-fp32", [*FP32_PARAMS, "train.steps=2"]),
    ):
        stages.train(config(stores, root / name, *COMMON, *sets))
    for name in ("resume-tp2", "resume-pp2"):
        shutil.copytree(root / "ckpt-single", root / name)
    spawn(run_stage, 2, "train", str(stores), [(str(root / n), [*COMMON, *BF16, *s]) for n, s in WORLD2.items()])
    # dp2 ZeRO-1's step-2 checkpoint resumed in one process, with bf16 and with fp32 parameters.
    for name, sets in (("resume-dp1", BF16), ("resume-fp32", FP32_PARAMS)):
        shutil.copytree(root / "dp2-zero1", root / name)
        shutil.rmtree(root / name / "checkpoints" / "step_0000004")
        stages.train(config(stores, root / name, *COMMON, *sets))
    shutil.copytree(root / "ckpt-fp32", root / "resume-bf16")
    stages.train(config(stores, root / "resume-bf16", *COMMON, *BF16))
    return root


def test_zero1_on_off_bit_identical_and_dp2_matches_one_process(runs, stores):
    zero, nozero, single = (masters(stores, runs / n) for n in ("dp2-zero1", "dp2-nozero", "single"))
    for name in single:
        assert torch.equal(zero[name], nozero[name]), name
    assert losses(runs / "dp2-zero1") == losses(runs / "dp2-nozero")
    assert grad_norms(runs / "dp2-zero1") == grad_norms(runs / "dp2-nozero")
    assert_params_close(zero, single, atol=1e-7, rtol=1e-6)
    assert losses(runs / "dp2-zero1") == pytest.approx(losses(runs / "single"), rel=1e-6)
    assert grad_norms(runs / "dp2-zero1") == grad_norms(runs / "single")  # the norm is dp-invariant, bitwise
    saved = final_params(stores, runs / "dp2-zero1")  # without an optimizer: the bf16 weights
    for name in single:
        assert torch.equal(saved[name], rounded_half_away(zero[name]).float()), name


@pytest.mark.parametrize(
    "name,reference",
    [("tp2-sp", "single"), ("pp2-tied", "single-tied"), ("resume-tp2", "single"), ("resume-pp2", "single")],
)
def test_tp2_pp2_and_resumes_within_bf16_tolerance(runs, stores, name, reference):
    sets = TIED if "tied" in reference else []
    assert len(losses(runs / name)) == 4
    assert losses(runs / name) == pytest.approx(losses(runs / reference), rel=2e-4)
    assert grad_norms(runs / name) == pytest.approx(grad_norms(runs / reference), rel=1e-2)
    got, want = masters(stores, runs / name, *sets), masters(stores, runs / reference, *sets)
    init = dict(build_model(config(stores, runs / "init", *sets), ParallelContext.single()).named_parameters())
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want])
    moved = torch.cat([(want[n] - init[n].detach()).flatten() for n in want])
    assert float(diff.abs().max()) < BF16_ATOL
    assert float(diff.norm()) < BF16_REL * float(moved.norm())


def test_zero1_checkpoint_resumes_at_dp1_and_as_fp32(runs, stores):
    single = masters(stores, runs / "single")
    assert losses(runs / "resume-dp1") == pytest.approx(losses(runs / "single"), rel=1e-6)
    assert_params_close(masters(stores, runs / "resume-dp1"), single, atol=1e-7, rtol=1e-6)
    assert losses(runs / "resume-fp32") == pytest.approx(losses(runs / "single"), rel=1e-3)
    assert_params_close(final_params(stores, runs / "resume-fp32"), single, atol=BF16_ATOL)


def test_fp32_bf16_cross_loads(runs, stores, tmp_path):
    """Loading with an optimizer: a bf16 run from an fp32 checkpoint takes its masters from the
    saved fp32 parameters; an fp32 run from a bf16 checkpoint takes its parameters from the
    masters. The moments carry over either way. Without an optimizer the weights are as saved."""
    pc = ParallelContext.single()
    fp32_ck, bf16_ck = latest_checkpoint(runs / "ckpt-fp32"), latest_checkpoint(runs / "ckpt-single")
    saved_fp32 = final_params(stores, runs / "ckpt-fp32")
    bf16 = Trainer(config(stores, tmp_path / "bf16", *COMMON, *BF16))
    load_checkpoint(fp32_ck, bf16.model, bf16.optimizer, pc)
    fp32 = Trainer(config(stores, tmp_path / "fp32", *COMMON, *FP32_PARAMS))
    load_checkpoint(fp32_ck, fp32.model, fp32.optimizer, pc)
    state, fp32_state = bf16.optimizer.state_dict()["state"], fp32.optimizer.state_dict()["state"]
    for name, p in bf16.model.named_parameters():
        assert torch.equal(state[name]["master"], saved_fp32[name]), name
        assert torch.equal(p.detach(), rounded_half_away(saved_fp32[name])), name
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][k], fp32_state[name][k]), (name, k)

    again = Trainer(config(stores, tmp_path / "fp32-again", *COMMON, *FP32_PARAMS))
    assert isinstance(again.optimizer, ShardedOptimizer)
    load_checkpoint(bf16_ck, again.model, again.optimizer, pc)
    want, frozen = masters(stores, runs / "ckpt-single"), final_params(stores, runs / "ckpt-single")
    raw = torch.load(bf16_ck / "optim_pp0_tp0_dp0.pt", weights_only=True)["state"]
    for name, p in again.model.named_parameters():
        assert torch.equal(p.detach(), raw[name]["master"]) and torch.equal(want[name], raw[name]["master"]), name
        assert torch.equal(frozen[name], rounded_half_away(raw[name]["master"]).float()), name
        assert set(again.optimizer.state_dict()["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
    assert any(not torch.equal(frozen[n], want[n]) for n in want)
    # The fp32 run continued with bf16 parameters stays within bf16 tolerance of the fp32 run.
    assert_params_close(masters(stores, runs / "resume-bf16"), final_params(stores, runs / "fp32"), atol=BF16_ATOL)


@pytest.mark.parametrize("sets,dtype,autocasts", [(BF16, torch.bfloat16, False), (FP32_PARAMS, torch.float32, True)])
def test_frozen_reference_computes_as_its_run_trains(runs, stores, tmp_path, sets, dtype, autocasts):
    """`load_frozen` (the DoReMi reference, `doremi score`, `doremi eval`) gives the model the
    parameter dtype the config trains in, and `autocast` the matching context: bf16 parameters
    without autocast, fp32 ones under it. Its losses equal those of the run's model loaded the
    same way (weights as saved, no optimizer)."""
    from doremi.methods.reference import load_frozen
    from trainer.parallel.pipeline_schedule import forward_only

    cfg = config(stores, tmp_path / "run", *COMMON, *sets)
    pc = ParallelContext.single()
    ck = latest_checkpoint(runs / "ckpt-single")
    frozen = load_frozen(cfg, ck, pc)
    assert {p.dtype for p in frozen.parameters()} == {dtype}
    assert isinstance(autocast(cfg, pc.device), torch.autocast) == autocasts
    trainer = Trainer(cfg)
    load_checkpoint(ck, trainer.model, None, pc)
    batches = trainer.feed.step_batches(1, trainer.hook.sampling_weights(1))
    with torch.inference_mode(), autocast(cfg, pc.device):
        got = forward_only(frozen, batches, pc)
        want = forward_only(trainer.model, batches, pc)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
