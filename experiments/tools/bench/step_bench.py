"""The framework's training step against the plain PyTorch baseline, on one GPU, in one invocation.

For each preset (the baseline's `1b` and `280m` = our `bench-1b` and `bench-280m`, same shapes and
micro-batch) it times, in this order:
- baseline: `plain_llama.py` in this folder (plain PyTorch, bf16 weights, fused AdamW on bf16),
  compiled; it reproduces the external baseline that runs up to 2026-12-04 copied in by hand;
- plain: our Llama (compiled: at tp = 1 the whole model with its head and cross entropy is one
  graph), bf16 parameters with fp32 master weights (`trainer.optim.master_weights`), `trainer.run.step.forward_backward` with the
  mean-token weighting, clipping at 1.0, AdamW;
- doremi-cached: the DoReMi proxy step (exact mode, `doremi.methods.doremi.method.DoReMi`) with reference
  losses from `doremi.methods.reference.CachedReference` (a cache written for the bench);
- doremi-online: the same with `OnlineReference`: a bf16 reference model forwarded without
  autograd before the proxy step;
- doremi-online fp8 (torchao installed, FP8 GPU): the same with the reference's linears in FP8
  (`mixing.doremi.reference_fp8`, `doremi.methods.reference.fp8_reference`);
- at 1B, plain again with recompute selective and full (peak memory against the plan);
- paired (`--paired`, default 1B): the baseline and plain steps both alive, timed in alternating
  windows, so that neither gets the cooler GPU of running first;
- at 1B (unless `--no-ablations`), the `ABLATIONS` rows: the plain step with one optimisation
  undone, chosen through the model's `trainer.model.ops.kernels.Kernels` switches or a TrainConfig
  field (see `Ablation`), and the trials.
Each line: tokens/s, model TFLOP/s, MFU against 989 TFLOP/s and against the bf16 matmul peak
measured at the start of the run, peak memory (max allocated during the timed steps minus what
was allocated before the configuration was built), `doremi plan`'s prediction
(`trainer.plan.memory.plan_memory`, bf16 parameters), and the host-device syncs seen per phase of one
step under torch.cuda.set_sync_debug_mode("warn").

FLOPs per token: the baseline's convention (`trainer.model.flops`): 6 N + 6 L d s, causal
attention counted half, recompute not counted. The online DoReMi step also counts the
reference forward (2 N + 2 L d s per token).

Usage (on a GPU, from the repository root):
    python experiments/tools/bench/step_bench.py [--presets 1b,280m] [--steps 8] [--deadline 270] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plain_llama  # noqa: E402

from data.config import DataConfig  # noqa: E402
from doremi.methods import reference_cache  # noqa: E402
from doremi.methods.doremi.config import DoReMiConfig  # noqa: E402
from doremi.methods.doremi.method import DoReMi  # noqa: E402
from doremi.methods.reference import CachedReference, OnlineReference, fp8_reference, freeze  # noqa: E402
from trainer.build import RunFacts  # noqa: E402
from trainer.config.fp8 import torchao_version  # noqa: E402
from trainer.config.presets import PRESETS  # noqa: E402
from trainer.config.schema import ModelConfig, ParallelismConfig, TrainConfig, TrainerConfig  # noqa: E402
from trainer.feed.weighting import MeanTokenLoss  # noqa: E402
from trainer.model.flops import flops_per_token, non_embedding_params  # noqa: E402
from trainer.model.fp8 import native_fp8  # noqa: E402
from trainer.model.llama import Llama  # noqa: E402
from trainer.model.ops import rope  # noqa: E402
from trainer.model.ops.kernels import Kernels  # noqa: E402
from trainer.optim import clip  # noqa: E402
from trainer.optim.build import build_optimizer  # noqa: E402
from trainer.optim.interface import Optimizer  # noqa: E402
from trainer.parallel.context import ParallelContext  # noqa: E402
from trainer.plan.memory import gpu_param_precision, plan_memory  # noqa: E402
from trainer.run.hooks import MethodContext, StepSignals  # noqa: E402
from trainer.run.signals import MethodWeighting  # noqa: E402
from trainer.run.step import domain_token_counts, forward_backward  # noqa: E402

DATASHEET_TFLOPS = 989.0
GIB = 2**30
K_DOMAINS = 4
UNIFORM = np.full(K_DOMAINS, 1.0 / K_DOMAINS)
#: baseline preset -> (our preset, micro-batch)
SHAPES = {name: (f"bench-{name}", shape.micro_batch) for name, shape in plain_llama.PRESETS.items()}
#: timing windows per configuration (the median is reported)
WINDOWS = 3
#: rough seconds of compile + timing per configuration, to stay inside --deadline
COST = {
    "baseline": 45,
    "plain": 35,
    "doremi-cached": 5,
    "doremi-online": 20,
    "doremi-online-fp8": 25,
    "selective": 20,
    "full": 10,
    "ablation": 40,
    "paired": 50,
}

#: The model's own kernel choices (`Kernels()`), shared as a default: the dataclass is frozen.
DEFAULT_KERNELS = Kernels()


@dataclass
class BenchRow:
    """What names a row of this bench and of method_bench (which times its presets): the preset,
    and the variant of the step on it."""

    preset: str
    variant: str


@dataclass
class Row(BenchRow):
    tokens_per_s: float = 0.0
    tflops: float = 0.0
    mfu_datasheet: float = 0.0
    mfu_measured: float = 0.0
    peak_gib: float = 0.0
    plan_gib: float | None = None
    syncs: str = ""
    note: str = ""
    windows: str = ""
    #: rows of one group are compared with that group's baseline and plain rows
    group: str = ""


def gpu_state() -> str:
    """The SM clock and the board power over NVML's last sample period ('' without pynvml): a
    sustained step that runs slower than a short profile of it, at the power limit, is running
    at a lower clock, not idling."""
    try:
        return f"@{torch.cuda.clock_rate()}MHz/{torch.cuda.power_draw() / 1000:.0f}W"
    except Exception:  # noqa: BLE001 - pynvml missing or NVML refused: report nothing
        return ""


def window_log(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms{gpu_state()}"


def timed(fn: Callable[[], None], iters: int, warmup: int, windows: int = 1, log: list[str] | None = None) -> float:
    """Seconds per call: the median over `windows` back-to-back windows of `iters` calls each
    (one window's mean hides a slow window; the median of a few does not). `log` gets each
    window's ms per call and the SM clock at its end."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if iters == 0:
        return 0.0
    means = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) / iters)
        if log is not None:
            log.append(window_log(means[-1]))
    return float(np.median(means))


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * 8192**3 / timed(lambda: a @ b, 10, 3) / 1e12


def attention_bench(out: list[str], priority: Sequence[SDPBackend]) -> None:
    """fwd+bwd of the 1B shape's attention per SDPA backend (GQA 32/8 heads, hd 64, causal), and
    which backend the model's `priority` picks."""
    from torch.nn.attention import sdpa_kernel

    b, h, kv, s, hd = 8, 32, 8, 2048, 64
    q = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    flops = 3 * 4 * b * h * s * s * hd / 2
    try:
        with sdpa_kernel(list(priority), set_priority=True):
            choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)
        out.append(f"attention: the model's SDPA priority picks {SDPBackend(choice).name} for this shape")
    except Exception as e:  # noqa: BLE001 - a private API: report, do not fail the bench
        out.append(f"attention: backend choice unknown ({str(e).splitlines()[0][:120]})")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

        def run(kk=k, vv=v, gqa=True):
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            o.backward(torch.ones_like(o))

        for label, fn in (
            ("gqa", run),
            ("expanded", lambda: run(k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1), False)),
        ):
            try:
                dt = timed(fn, 10, 2)
                out.append(
                    f"attention {backend.name} {label}: {dt * 1e3:.2f} ms fwd+bwd, {flops / dt / 1e12:.0f} TFLOP/s"
                )
            except Exception as e:  # noqa: BLE001 - report which backends run here
                out.append(f"attention {backend.name} {label}: unsupported ({str(e).splitlines()[0][:120]})")
            q.grad = k.grad = v.grad = None


def own_peak(base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / GIB


def free() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def count_syncs(phases: list[tuple[str, Callable[[], None]]]) -> str:
    """Host-device synchronisations per phase of one step (torch.cuda.set_sync_debug_mode)."""
    counts = []
    for name, fn in phases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("synchroniz" in str(w.message) for w in seen)
        counts.append(f"{name}={n}")
    torch.cuda.synchronize()
    return " ".join(counts)


# -- the baseline ----------------------------------------------------------------------------


def baseline_step(name: str, device: torch.device, compile: bool = True) -> tuple[Callable[[], None], int, int]:
    """The baseline's training step on its preset `name` (`plain_llama.make_step`): (step, FLOPs
    per token, tokens per step)."""
    return plain_llama.make_step(name, device, compile)


def run_baseline(name: str, steps: int, peak: float, device: torch.device) -> Row:
    base = free()
    step, fpt, tokens = baseline_step(name, device)
    timed(step, 0, 3)
    torch.cuda.reset_peak_memory_stats()
    log: list[str] = []
    dt = timed(step, steps, 0, WINDOWS, log)
    row = _row(name, "baseline --compile", tokens / dt, fpt, peak, own_peak(base))
    row.windows = " ".join(log)
    row.syncs = count_syncs([("step", step)])
    del step
    return row


def paired_windows(
    steps: dict[str, Callable[[], None]], iters: int, rounds: int, log: dict[str, list[str]] | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each step over `2 * rounds` windows of `iters` calls, the steps taking
    turns in the order A B B A A B ... so that a slow drift of the clock (the GPU warming up,
    power) falls on each equally; synchronised at the window ends only."""
    names = list(steps)
    seen: dict[str, list[float]] = {n: [] for n in names}
    for r in range(2 * rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[name]()
            torch.cuda.synchronize()
            seen[name].append((time.perf_counter() - t0) / iters)
            if log is not None:
                log[name].append(window_log(seen[name][-1]))
    return seen


def run_paired(
    name: str, steps: int, peak: float, device: torch.device, emit: Callable[[Row], None], kernels: Kernels
) -> None:
    """The baseline and the plain framework step both alive, timed in alternating windows
    (`paired_windows`): their ratio without the order of the main rows (the baseline always
    first, on a cooler GPU). Peak memory is not reported (both models share the GPU)."""
    preset, mb = SHAPES[name]
    pc = ParallelContext.single(device)
    cfg = trainer_config(preset, mb, "none")
    facts = RunFacts.resolve(cfg, pc)
    model = Llama(cfg.model, cfg.parallelism, pc, seed=0, kernels=kernels)
    ours = FrameworkStep(
        facts, model, framework_optimizer(model, cfg, pc, facts), pc, make_batch(cfg, mb, seed=1, device=device)
    )
    theirs, base_fpt, tokens = baseline_step(name, device)
    for fn in (theirs, ours):
        timed(fn, 0, 3)
    log: dict[str, list[str]] = {"baseline": [], "plain": []}
    seen = paired_windows({"baseline": theirs, "plain": ours}, steps, WINDOWS + 1, log)
    for key, variant, fpt in (
        ("baseline", "baseline --compile", base_fpt),
        ("plain", "plain", flops_per_token(cfg.model, cfg.data.seq_len)),
    ):
        row = _row(name, variant, tokens / float(np.median(seen[key])), fpt, peak, 0.0)
        row.group = "paired"
        row.windows = " ".join(log[key])
        row.note = "alternating windows, both alive"
        emit(row)
    del ours, model, theirs


def _row(preset: str, variant: str, tps: float, fpt: float, peak: float, peak_gib: float) -> Row:
    tflops = tps * fpt / 1e12
    return Row(preset, variant, tps, tflops, tflops / DATASHEET_TFLOPS, tflops / peak, peak_gib)


# -- the framework ---------------------------------------------------------------------------


def trainer_config(preset: str, mb: int, recompute: str) -> TrainerConfig:
    model = ModelConfig(**PRESETS[preset], preset=preset, compile=True)
    return TrainerConfig(
        model=model,
        data=DataConfig(seq_len=model.max_seq_len),
        train=TrainConfig(global_batch_size=mb, micro_batches=1, lr=1e-4, precision="bf16"),
        parallelism=ParallelismConfig(recompute=recompute),
    )


def predicted_gib(cfg: TrainerConfig) -> float:
    return plan_memory(cfg, 1, 141.0, param_precision=gpu_param_precision(cfg)).peak_bytes / GIB


def make_batch(cfg: TrainerConfig, mb: int, seed: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    v, s = cfg.model.vocab_size, cfg.data.seq_len
    ids = torch.randint(0, v, (mb, s), device=device, generator=g)
    labels = torch.randint(0, v, (mb, s), device=device, generator=g)
    domains = torch.arange(mb, device=device) % K_DOMAINS
    sequences = torch.arange(mb) // K_DOMAINS
    return {
        "input_ids": ids,
        "labels": labels,
        "domain_ids": domains,
        "sequence_ids": sequences.to(device),
        "items": torch.stack([torch.arange(mb) % K_DOMAINS, sequences], dim=1),
    }


def write_cache(directory: Path, mb: int, seq: int) -> list[str]:
    """A reference-loss cache of random losses for the bench's sequence ids, written by the
    cache's owner (`mixing.doremi.reference_cache`) as `doremi score` writes it; its domain names."""
    domains = [f"d{i}" for i in range(K_DOMAINS)]
    per_domain = -(-mb // K_DOMAINS)
    staging = reference_cache.staging_dir(directory)
    reference_cache.create_arrays(staging, domains, [per_domain] * K_DOMAINS, seq)
    rng = np.random.default_rng(0)
    for d in domains:
        arr = reference_cache.open_for_scoring(staging, d)
        arr[:] = rng.uniform(9.0, 11.0, arr.shape).astype(np.float32)
        arr.flush()
        del arr
    reference_cache.publish(
        staging,
        directory,
        domains,
        seq,
        {"reference": "step_bench (random losses)", "reference_fingerprint": "random-losses"},
        steps=10**9,
        global_batch_size=mb,
        seed=0,
        sampling=[1.0 / K_DOMAINS] * K_DOMAINS,
        sequences=[per_domain] * K_DOMAINS,
    )
    return domains


def framework_optimizer(model: torch.nn.Module, cfg: TrainerConfig, pc: ParallelContext, facts: RunFacts) -> Optimizer:
    """The optimizer `trainer.run.loop.Trainer` builds for this config (its `facts`) on this device."""
    return build_optimizer(
        list(model.named_parameters()), cfg.train, pc, cfg.parallelism.zero1, param_dtype=facts.param_dtype
    )


class FrameworkStep:
    """One optimizer step of the framework, as `trainer.run.loop.Trainer.train_step` runs it
    (forward and backward under the trainer's autocast for the config's `facts`)."""

    def __init__(
        self, facts: RunFacts, model, opt: Optimizer, pc: ParallelContext, batch: dict, hook: DoReMi | None = None
    ):
        self.model, self.opt, self.pc, self.batch, self.hook = model, opt, pc, batch, hook
        self.amp = facts.autocast()
        self.step_no = 0
        self._stats = None
        self._signals: StepSignals | None = None

    def phases(self) -> list[tuple[str, Callable[[], None]]]:
        out = []
        if self.hook is not None:
            out.append(("reference", self._reference))
        out += [("fwd_bwd", self._fwd_bwd), ("optimizer", self._optimizer)]
        if self.hook is not None:
            out.append(("doremi_log", self._after))
        return out

    def _reference(self) -> None:
        self.hook.prepare_batches(self.step_no + 1, [self.batch])

    def _fwd_bwd(self) -> None:
        self.step_no += 1
        batches = [self.batch]
        tokens = domain_token_counts(batches, K_DOMAINS, self.pc)
        if self.hook is None:
            weighting, schedule = MeanTokenLoss(tokens.sum()), "1f1b"
        else:
            self._signals = StepSignals(weights=UNIFORM, sequences=np.zeros(K_DOMAINS, dtype=np.int64), tokens=tokens)
            weighting, schedule = MethodWeighting(self.hook, self.step_no, self._signals, self.pc, K_DOMAINS), "afab"
        with self.amp:
            self._stats = forward_backward(self.model, batches, weighting, self.pc, schedule, K_DOMAINS)
        if self._signals is not None:
            weighting.finish(self._stats.local_losses, batches)
            self._signals.loss_sum = self._stats.domain_loss_sum

    def _optimizer(self) -> None:
        self.opt.reduce_gradients()
        self._stats.grad_norm = self.opt.clip_grad_norm(1.0)
        self.opt.step(1e-4)
        self.opt.zero_grad()

    def _after(self) -> None:
        self.hook.after_step(self.step_no, self._signals)

    def __call__(self) -> None:
        for _, fn in self.phases():
            fn()


def fp8_reference_runs(device: torch.device, row: str = "doremi-online-fp8") -> bool:
    """`mixing.doremi.reference_fp8`'s row runs here: torchao installed and `torch._scaled_mm`
    on the device (elsewhere torchao emulates FP8, slower than bf16: nothing to time). Where it
    does not, one line says that `row` (the caller's name for it; method_bench's `doremi-fp8`)
    is skipped."""
    if torchao_version() is None or not native_fp8(device):
        print(f"skipped {row}: needs torchao (.[fp8]) and an FP8 GPU", flush=True)
        return False
    return True


def make_hook(run_dir: Path, pc: ParallelContext, reference) -> DoReMi:
    ctx = MethodContext(
        domains=[f"d{i}" for i in range(K_DOMAINS)],
        run_dir=run_dir,
        is_main=pc.is_main,
        device=pc.device,
        seed=0,
        steps=0,
        global_batch_size=0,
        seq_len=0,
        train_tokens=[0] * K_DOMAINS,
        pc=pc,
    )
    return DoReMi(DoReMiConfig(), ctx, UNIFORM, reference)


def measure(
    preset: str,
    variant: str,
    step: FrameworkStep,
    steps: int,
    warmup: int,
    fpt: float,
    peak: float,
    base: int,
    plan: float | None,
) -> Row:
    timed(step, 0, warmup)
    torch.cuda.reset_peak_memory_stats()
    log: list[str] = []
    dt = timed(step, steps, 0, WINDOWS, log)
    mb, seq = step.batch["input_ids"].shape
    row = _row(preset, variant, mb * seq / dt, fpt, peak, own_peak(base))
    row.windows = " ".join(log)
    row.plan_gib = plan
    row.syncs = count_syncs(step.phases())
    return row


def run_framework(
    name: str,
    steps: int,
    peak: float,
    tmp: Path,
    emit: Callable[[Row], None],
    time_left: Callable[[str], bool],
    device: torch.device,
    doremi: bool,
    recompute: Sequence[str] = (),
    kernels: Kernels = DEFAULT_KERNELS,
) -> None:
    preset, mb = SHAPES[name]
    pc = ParallelContext.single(device)
    cfg = trainer_config(preset, mb, "none")
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    ref_fpt = 2 * non_embedding_params(cfg.model) + 2 * cfg.model.n_layers * cfg.model.d_model * cfg.data.seq_len
    base = free()
    facts = RunFacts.resolve(cfg, pc)
    model = Llama(cfg.model, cfg.parallelism, pc, seed=0, kernels=kernels)
    opt = framework_optimizer(model, cfg, pc, facts)
    batch = make_batch(cfg, mb, seed=1, device=pc.device)

    plain = FrameworkStep(facts, model, opt, pc, batch)
    emit(measure(name, "plain", plain, steps, 3, fpt, peak, base, predicted_gib(cfg)))

    if doremi and time_left("doremi-cached"):
        cache = tmp / f"cache-{name}"
        domains = write_cache(cache, mb, cfg.data.seq_len)
        arrays = reference_cache.open_cache(
            cache, domains, cfg.data.seq_len, steps, mb, seed=0, sampling=[1.0 / K_DOMAINS] * K_DOMAINS, synthetic=True
        )
        ref = CachedReference(cache, domains, arrays, pc.device)
        step = FrameworkStep(facts, model, opt, pc, batch, make_hook(tmp / f"cached-{name}", pc, ref))
        emit(measure(name, "doremi cached ref", step, steps, 2, fpt, peak, base, None))

    if doremi and time_left("doremi-online"):
        ref_model = freeze(Llama(cfg.model, cfg.parallelism, pc, seed=1, kernels=kernels), facts)
        ref = OnlineReference(ref_model, facts, pc)
        step = FrameworkStep(facts, model, opt, pc, batch, make_hook(tmp / f"online-{name}", pc, ref))
        row = measure(name, "doremi online ref", step, steps, 3, fpt + ref_fpt, peak, base, None)
        row.note = "MFU counts the reference forward"
        emit(row)
        del ref_model, ref, step
        free()

    if doremi and fp8_reference_runs(device) and time_left("doremi-online-fp8"):
        ref_cfg = fp8_reference(cfg, "step_bench")
        ref_model = freeze(Llama(ref_cfg.model, cfg.parallelism, pc, seed=1, kernels=kernels), facts)
        ref = OnlineReference(ref_model, facts, pc)
        step = FrameworkStep(facts, model, opt, pc, batch, make_hook(tmp / f"online-fp8-{name}", pc, ref))
        row = measure(name, "doremi online ref fp8", step, steps, 3, fpt + ref_fpt, peak, base, None)
        row.note = f"MFU counts the reference forward; its {', '.join(ref_cfg.model.fp8.layers)} in FP8"
        emit(row)
        del ref_model, ref, step
        free()

    # Last for this model: the same model and optimizer with recompute selective, then full.
    # (Nothing else may be alive then: peak memory counts from `base`.)
    for mode in recompute:
        if not time_left(mode):
            continue
        model.set_recompute(mode)
        row = measure(
            name,
            f"plain recompute={mode}",
            FrameworkStep(facts, model, opt, pc, batch),
            steps,
            3,
            fpt,
            peak,
            base,
            predicted_gib(trainer_config(preset, mb, mode)),
        )
        emit(row)


def earlier_rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`trainer.model.ops.rope.rope_qkv` in the form before it (2026-12-03): the rotation's products
    in the activation dtype, v a view of qkv."""
    s, b, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    c, sn = cos[:s, None, None, :].to(qkv.dtype), sin[:s, None, None, :].to(qkv.dtype)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)

    return rot(q.view(s, b, heads, hd)), rot(k.view(s, b, kv_heads, hd)), v.view(s, b, kv_heads, hd)


def inductor_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, ignore_index: int
) -> torch.Tensor:
    """`trainer.model.ops.cross_entropy.cross_entropy` in the form before it (2026-12-04): torch ops
    that inductor compiles with the head."""
    z = logits[..., :vocab_size].float()
    return torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(target.shape)


@contextlib.contextmanager
def foreach_grad_norm():
    """The gradient norm by `_foreach_norm` instead of the Triton sums of squares. This choice is
    made in `trainer.optim.clip`, outside the model, so it is no `Kernels` switch: it replaces
    `clip.uses_triton_squares` while the row runs, after checking that `clip.squares` does consult
    that name (a rename would otherwise time the plain step under this label)."""
    asked: list[int] = []

    def never(tensors: Sequence[torch.Tensor]) -> bool:
        asked.append(len(tensors))
        return False

    saved = clip.uses_triton_squares
    clip.uses_triton_squares = never
    try:
        clip.squares([torch.ones(1)])
        if not asked:
            raise RuntimeError(
                "foreach_grad_norm: trainer.optim.clip.squares no longer consults "
                "clip.uses_triton_squares; the ablation would time the plain step"
            )
        yield
    finally:
        clip.uses_triton_squares = saved


@contextlib.contextmanager
def tunable_gemms():
    """PyTorch's TunableOp: each GEMM shape's first call times cuBLAS(Lt)'s candidate algorithms
    and keeps the fastest (the warm-up steps pay for it)."""
    tunable = torch.cuda.tunable
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(30)
    tunable.set_filename(str(Path(tempfile.gettempdir()) / "tunableop_results.csv"))
    try:
        yield
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)


@dataclass
class Ablation:
    """One row timed like the plain 1B step on a fresh model, after the main rows: an `ablation:`
    undoes one optimisation of the framework, a `trial:` tries a candidate it does not have
    (measured no faster, runs 10-11). The model is built with `Kernels` fields `kernels` changed
    (an unknown field is an error), the config with TrainConfig fields `train` changed, and the
    row runs inside `context`."""

    label: str
    train: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def model_kernels(self, base: Kernels) -> Kernels:
        return replace(base, **self.kernels)


FLASH_FIRST = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

ABLATIONS = [
    Ablation("ablation: fp32 params + torch AdamW (no master weights)", train={"param_dtype": "fp32"}),
    Ablation("ablation: flash attention first (not cuDNN)", kernels={"sdpa_priority": FLASH_FIRST}),
    Ablation(
        "ablation: RoPE in the earlier form (bf16 products, v a view of qkv)", kernels={"rope_qkv": earlier_rope_qkv}
    ),
    Ablation(
        "ablation: RoPE by inductor (the same math in torch ops, not the Triton op)",
        kernels={"rope_qkv": rope.rope_qkv_torch},
    ),
    Ablation(
        "ablation: cross entropy by inductor (not the Triton op)", kernels={"cross_entropy": inductor_cross_entropy}
    ),
    Ablation("ablation: gradient norm by _foreach_norm (not the Triton sums of squares)", context=foreach_grad_norm),
    Ablation("trial: GEMM algorithms tuned per shape (TunableOp)", context=tunable_gemms),
]


def run_ablations(
    name: str,
    steps: int,
    peak: float,
    emit: Callable[[Row], None],
    time_left: Callable[[str], bool],
    matching: str = "",
    kernels: Kernels = DEFAULT_KERNELS,
) -> None:
    preset, mb = SHAPES[name]
    pc = ParallelContext.single(torch.device("cuda"))
    for ablation in ABLATIONS:
        if matching and not any(m in ablation.label for m in matching.split(",")) or not time_left("ablation"):
            continue
        cfg = trainer_config(preset, mb, "none")
        cfg = replace(cfg, train=replace(cfg.train, **ablation.train))
        fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        try:
            with ablation.context():
                base = free()
                facts = RunFacts.resolve(cfg, pc)
                model = Llama(cfg.model, cfg.parallelism, pc, seed=0, kernels=ablation.model_kernels(kernels))
                opt = framework_optimizer(model, cfg, pc, facts)
                step = FrameworkStep(facts, model, opt, pc, make_batch(cfg, mb, seed=1, device=pc.device))
                emit(measure(name, ablation.label, step, steps, 3, fpt, peak, base, None))
                del model, opt, step
        finally:
            free()


def format_table(rows: list[Row]) -> str:
    head = [
        "preset",
        "variant",
        "tokens/s",
        "TFLOP/s",
        "MFU(989)",
        "MFU(meas)",
        "peak GiB",
        "plan GiB",
        "vs base",
        "vs plain",
        "syncs",
    ]
    lines = []
    base = {(r.preset, r.group): r.tokens_per_s for r in rows if r.variant.startswith("baseline")}
    plain = {(r.preset, r.group): r.tokens_per_s for r in rows if r.variant == "plain"}
    for r in rows:
        key = (r.preset, r.group)
        vb = f"{r.tokens_per_s / base[key]:.3f}" if key in base and r.tokens_per_s else "-"
        vp = f"{r.tokens_per_s / plain[key]:.3f}" if key in plain and r.tokens_per_s else "-"
        variant = f"{r.variant} ({r.group})" if r.group else r.variant
        lines.append(
            [
                r.preset,
                variant,
                f"{r.tokens_per_s:,.0f}",
                f"{r.tflops:.0f}",
                f"{r.mfu_datasheet:.1%}",
                f"{r.mfu_measured:.1%}",
                "-" if r.group == "paired" else f"{r.peak_gib:.1f}",
                "-" if r.plan_gib is None else f"{r.plan_gib:.1f}",
                vb,
                vp,
                r.syncs or r.note,
            ]
        )
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(x) for x in lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="1b,280m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--doremi-presets", default="1b,280m", help="presets that also time the DoReMi proxy steps")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds: skip configurations that would end later")
    p.add_argument("--out", type=Path, default=None, help="directory for bench.json")
    p.add_argument(
        "--paired",
        default="1b",
        help="presets whose baseline and plain steps are also timed in alternating windows ('' for none)",
    )
    p.add_argument(
        "--no-ablations",
        dest="ablations",
        action="store_false",
        help="skip the 1B ablation rows (each undoes one optimisation)",
    )
    p.add_argument(
        "--ablations-matching",
        default="",
        help="only the ablations and trials whose label contains one of these (comma-separated)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_bench: needs a CUDA device")
    # One process compiles every configuration's blocks (two shapes, training and inference,
    # recompute modes, ablations): more variants of one function than dynamo's default of 8,
    # past which it would silently run the rest eagerly.
    torch._dynamo.config.recompile_limit = 64
    device = torch.device("cuda")
    t0 = time.perf_counter()
    rows: list[Row] = []
    notes: list[str] = []

    def emit(row: Row) -> None:
        rows.append(row)
        variant = f"{row.variant} ({row.group})" if row.group else row.variant
        print(
            f"{row.preset} {variant}: {row.tokens_per_s:,.0f} tok/s, {row.tflops:.0f} TFLOP/s, "
            f"MFU {row.mfu_datasheet:.1%} (989) {row.mfu_measured:.1%} (measured), peak {row.peak_gib:.1f} GiB, "
            f"plan {row.plan_gib}, syncs [{row.syncs}] windows [{row.windows}] {row.note}  "
            f"(t={time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
        if args.out:
            (args.out / "bench.json").write_text(
                json.dumps({"rows": [asdict(r) for r in rows], "notes": notes}, indent=1)
            )

    def time_left(what: str) -> bool:
        ok = time.perf_counter() - t0 + COST[what] < args.deadline
        if not ok:
            notes.append(f"skipped {what}: deadline")
            print(f"skipped {what}: deadline", flush=True)
        return ok

    peak = matmul_peak()
    head = (
        f"{torch.cuda.get_device_name(0)} torch={torch.__version__} cudnn={torch.backends.cudnn.version()} "
        f"bf16 matmul peak {peak:.0f} TFLOP/s"
    )
    print(head, flush=True)
    notes.append(head)
    kernels = Kernels()
    attention_bench(notes, kernels.sdpa_priority)
    print("\n".join(notes[1:]), flush=True)

    def guarded(label: str, fn: Callable[[Kernels], None]) -> None:
        """Run `fn` with the run's kernels; on a cuDNN failure, drop cuDNN attention from them
        for the rest of the run and try once more."""
        nonlocal kernels
        try:
            fn(kernels)
        except Exception:  # noqa: BLE001 - keep the other configurations' numbers
            msg = traceback.format_exc()
            print(msg, flush=True)
            notes.append(f"{label} failed at t={time.perf_counter() - t0:.0f}s: {msg.strip().splitlines()[-1][:300]}")
            if "cudnn" in msg.lower() and kernels.sdpa_priority[0] == SDPBackend.CUDNN_ATTENTION:
                kernels = replace(kernels, sdpa_priority=kernels.sdpa_priority[1:])
                notes.append("cuDNN attention dropped from the SDPA priority for the rest of the run")
                free()
                if time_left("plain"):
                    guarded(label + " (flash attention)", fn)
        free()

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets.split(","):
            if time_left("baseline"):
                guarded(f"{name} baseline", lambda _: emit(run_baseline(name, args.steps, peak, device)))
            if time_left("plain"):
                guarded(
                    f"{name} framework",
                    lambda k: run_framework(
                        name,
                        args.steps,
                        peak,
                        Path(tmp),
                        emit,
                        time_left,
                        device,
                        name in args.doremi_presets.split(","),
                        ("selective", "full") if name == "1b" else (),
                        k,
                    ),
                )
        for name in args.paired.split(",") if args.paired else ():
            if time_left("paired"):
                guarded(f"{name} paired", lambda k: run_paired(name, args.steps, peak, device, emit, k))
        if args.ablations and "1b" in args.presets.split(","):
            guarded(
                "1b ablations",
                lambda k: run_ablations("1b", args.steps, peak, emit, time_left, args.ablations_matching, k),
            )
    counters = torch._dynamo.utils.counters
    notes.append(
        f"dynamo graph breaks: {dict(counters['graph_break'])}; "
        f"unique graphs: {counters['stats'].get('unique_graphs', 0)}"
    )
    print(notes[-1])
    print("\n" + format_table(rows), flush=True)
    if args.out:
        (args.out / "bench.json").write_text(json.dumps({"rows": [asdict(r) for r in rows], "notes": notes}, indent=1))
        (args.out / "table.txt").write_text(format_table(rows) + "\n\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
