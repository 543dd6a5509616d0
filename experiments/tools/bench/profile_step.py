"""Where a step's time and memory go, on one GPU: the evidence behind experiments/notes/PERFORMANCE.md.

Measurements, each guarded so that one failure keeps the others:
- `kernels`: torch.profiler over two steps of the baseline (`plain_llama.py`, compiled) and of
  the framework's plain step at one shape; the CUDA kernels grouped into classes (matmul, attention forward and
  backward, optimizer, elementwise/reduction, copies, communication) with their time per step,
  plus the top kernels by total time. The difference between the two columns is where the
  framework gains or loses against the baseline.
- `swiglu`: the SwiGLU backward alone, inductor's kernel against the Triton op.
- `timeline`: whether the step is GPU-bound, without the profiler: per phase the host's issue
  time against the GPU's time (CUDA events), and the host's lead at each step start.
- `activations`: bytes each block (and the head + loss) keeps alive from its forward to its
  backward, per recompute mode, read from the allocator (`torch.cuda.memory_allocated` after each
  block's forward, so what the compiled graph really saves), against
  `CostModel.layer_activation_bytes` / `head_activation_bytes`; and the step's peak over what was
  allocated before it.

Usage (GPU, repository root):
    python experiments/tools/bench/profile_step.py [--preset 1b] [--sections kernels,activations] --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_bench as sb  # noqa: E402

from trainer.build import RunFacts  # noqa: E402
from trainer.model.llama import Llama  # noqa: E402
from trainer.parallel.context import ParallelContext  # noqa: E402
from trainer.plan.cost_model import CostModel  # noqa: E402

MIB = 2**20

#: kernel-name fragments -> class, first match wins (lower-case names)
CLASSES = (
    (
        "attention bwd",
        (
            "flash_bwd",
            "cudnn_bwd",
            "fmha_bwd",
            "attn_bwd",
            "dgrad_engine",
            "bprop",
            "dq_dk_dv",
            "convert_dq",
            "dot_do_o",
        ),
    ),
    ("attention fwd", ("flash_fwd", "fmha", "cudnn", "attn", "fprop", "sdpa")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "wgmma", "matmul", "sgemm", "hgemm")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adamw")),
    ("triton (fused elementwise / norm / loss)", ("triton",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ("communication", ("nccl",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in CLASSES:
        if any(k in low for k in keys):
            return label
    return "other (aten elementwise / reduction)"


def idle_time(prof, steps: int) -> tuple[float, float, list[tuple[float, str]]]:
    """GPU timeline of the profiled window: (ms from the first kernel's start to the last one's
    end, ms in which no kernel ran, the largest gaps with the kernel that ended each), per step."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"
    )
    if not spans:
        return 0.0, 0.0, []
    idle, gaps, end, last = 0.0, [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            idle += start - end
            gaps.append((start - end, last))
        if stop >= end:
            end, last = stop, name
    gaps.sort(reverse=True)
    return (end - spans[0][0]) / 1e3 / steps, idle / 1e3 / steps, [(g / 1e3, n) for g, n in gaps[:8]]


def profile(fn, steps: int = 2) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Per-class and per-kernel CUDA time (ms per step) over `steps` calls of `fn`; the class
    `idle` is GPU time between kernels (from `idle_time`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_class: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        ms = t / 1e3 / steps
        by_class[kernel_class(e.key)] += ms
        kernels.append((e.key, ms, e.count // steps))
    kernels.sort(key=lambda x: -x[1])
    span, idle, gaps = idle_time(prof, steps)
    by_class["idle (no kernel running)"] = idle
    kernels.append(
        (
            f"GPU span {span:.2f} ms per step; largest gaps (ms, after): "
            + "; ".join(f"{g:.2f} {n[:60]}" for g, n in gaps),
            0.0,
            0,
        )
    )
    return dict(by_class), kernels


def framework_step(name: str) -> sb.FrameworkStep:
    """The framework's step of step_bench's shape `name` on one GPU, without activation
    recomputation (what both sections profile)."""
    preset, mb = sb.SHAPES[name]
    pc = ParallelContext.single(torch.device("cuda"))
    cfg = sb.trainer_config(preset, mb, "none")
    facts = RunFacts.resolve(cfg, pc)
    model = Llama(cfg.model, cfg.parallelism, pc, seed=0)
    return sb.FrameworkStep(
        facts, model, sb.framework_optimizer(model, cfg, pc, facts), pc, sb.make_batch(cfg, mb, 1, pc.device)
    )


def kernels_section(args, out: list[str]) -> None:
    base_step, _, _ = sb.baseline_step(args.preset, torch.device("cuda"))
    base_cls, base_k = profile(base_step)
    del base_step
    sb.free()

    step = framework_step(args.preset)
    our_cls, our_k = profile(step)
    del step
    sb.free()

    out.append(f"## kernels, {args.preset}: CUDA ms per step (torch.profiler, 2 steps after 2 warm-up)")
    out.append(f"{'class':44s} {'baseline':>9s} {'framework':>9s} {'diff':>8s}")
    for c in sorted(set(base_cls) | set(our_cls), key=lambda c: -max(base_cls.get(c, 0), our_cls.get(c, 0))):
        b, o = base_cls.get(c, 0.0), our_cls.get(c, 0.0)
        out.append(f"{c:44s} {b:9.2f} {o:9.2f} {o - b:+8.2f}")
    out.append(
        f"{'total (kernels + idle)':44s} {sum(base_cls.values()):9.2f} {sum(our_cls.values()):9.2f} "
        f"{sum(our_cls.values()) - sum(base_cls.values()):+8.2f}"
    )
    for label, ks in (("baseline", base_k), ("framework", our_k)):
        out.append(f"\n### top kernels, {label} (ms per step, calls per step)")
        out.append(ks[-1][0])
        for name, ms, n in ks[:-1][: args.top]:
            out.append(f"{ms:8.2f} {n:5d}  {kernel_class(name)[:12]:12s} {name[:150]}")


def timeline_section(args, out: list[str]) -> None:
    """Is the framework's step GPU-bound? Without the profiler (whose per-launch cost can make the
    host look slow), over 12 steps: for each phase, the host time spent issuing it and the GPU
    time it took (CUDA events between phases), and at each step start the host's lead, i.e. how
    much earlier the host issued the step than the GPU began it. A lead near zero or below means
    the GPU waited for the host at that point."""
    step = framework_step(args.preset)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    phases = step.phases()
    origin = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    origin.record()
    marks: list[tuple[str, float, torch.cuda.Event]] = []
    for _ in range(12):
        for name, fn in phases:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((name, time.perf_counter() - t0, ev))
            fn()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    host_end = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu = [origin.elapsed_time(ev) / 1e3 for _, _, ev in marks] + [origin.elapsed_time(end) / 1e3]
    host = [h for _, h, _ in marks] + [host_end]
    by_phase: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for i, (name, _, _) in enumerate(marks):
        by_phase[name].append((host[i + 1] - host[i], gpu[i + 1] - gpu[i]))
    starts = [i for i, (name, _, _) in enumerate(marks) if name == phases[0][0]]
    leads = [(gpu[i] - host[i]) * 1e3 for i in starts]
    out.append(f"\n## timeline, {sb.SHAPES[args.preset][0]}, 12 steps without the profiler (ms)")
    out.append(f"{'phase':12s} {'host issue':>10s} {'GPU':>8s}   (median over steps)")
    for name, vals in by_phase.items():
        hs, gs = sorted(v[0] for v in vals), sorted(v[1] for v in vals)
        out.append(f"{name:12s} {hs[len(hs) // 2] * 1e3:10.2f} {gs[len(gs) // 2] * 1e3:8.2f}")
    per_step = [(gpu[b] - gpu[a]) * 1e3 for a, b in zip(starts, starts[1:])]
    out.append(f"GPU ms per step: {' '.join(f'{x:.1f}' for x in per_step)}")
    out.append(
        f"wall ms per step (host end to end / 12): {(host_end) * 1e3 / 12:.1f}; "
        f"GPU end to end / 12: {gpu[-1] * 1e3 / 12:.1f}"
    )
    out.append(f"host lead at each step start: {' '.join(f'{x:.1f}' for x in leads)}")
    del step
    sb.free()


def activations_section(args, out: list[str]) -> None:
    preset, mb = sb.SHAPES[args.preset]
    pc = ParallelContext.single(torch.device("cuda"))
    out.append(f"\n## activations kept for backward, {preset}, micro-batch {mb} (MiB)")
    out.append(
        f"{'mode':10s} {'block meas':>10s} {'block plan':>10s} {'head meas':>10s} {'head plan':>10s} "
        f"{'step peak - base':>16s}"
    )
    model = None
    for mode in ("none", "selective", "full"):
        cfg = sb.trainer_config(preset, mb, mode)
        if model is None:
            facts = RunFacts.resolve(cfg, pc)  # the same for every recompute mode
            model = Llama(cfg.model, cfg.parallelism, pc, seed=0)
            opt = sb.framework_optimizer(model, cfg, pc, facts)
            batch = sb.make_batch(cfg, mb, 1, pc.device)
        model.set_recompute(mode)
        step = sb.FrameworkStep(facts, model, opt, pc, batch)
        sb.timed(step, 0, 3)
        marks: list[int] = []
        hooks = [
            b.register_forward_hook(lambda *_: marks.append(torch.cuda.memory_allocated()))
            for b in model.layers.values()
        ]
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        losses = model(None, batch)
        after = torch.cuda.memory_allocated()
        for h in hooks:
            h.remove()
        losses.mean().backward()
        opt.zero_grad()
        torch.cuda.synchronize()
        step_peak = torch.cuda.max_memory_allocated() - start
        deltas = [b - a for a, b in zip(marks[:-1], marks[1:])]
        block = sorted(deltas)[len(deltas) // 2]
        head = after - marks[-1]
        cm = CostModel.from_config(cfg.model, cfg.parallelism, mb, cfg.data.seq_len, 1, "bf16")
        out.append(
            f"{mode:10s} {block / MIB:10.1f} {cm.layer_activation_bytes() / MIB:10.1f} {head / MIB:10.1f} "
            f"{cm.head_activation_bytes() / MIB:10.1f} {step_peak / MIB:16.1f}"
        )
        del losses
    del model, opt
    sb.free()


def swiglu_section(args, out: list[str]) -> None:
    """The SwiGLU backward alone at this preset's shape: inductor's kernel for the torch
    expression against the Triton op; error against float64; bandwidth over 3 reads + 2 writes."""
    from triton.testing import do_bench

    from trainer.model.ops.swiglu import swiglu_backward_torch, swiglu_backward_triton

    preset, mb = sb.SHAPES[args.preset]
    cfg = sb.trainer_config(preset, mb, "none")
    n, f = mb * cfg.data.seq_len, cfg.model.ffn_dim
    gu = torch.randn(n, 2 * f, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, f, device="cuda", dtype=torch.bfloat16)
    ref = swiglu_backward_torch(g.double(), gu.double())
    compiled = torch.compile(swiglu_backward_torch, dynamic=False)
    nbytes = 5 * n * f * 2
    out.append(f"\n## SwiGLU backward, {n} tokens x f={f}, bf16 (median ms of do_bench)")
    for label, fn in (("inductor (torch expression)", compiled), ("triton op", swiglu_backward_triton)):
        res = fn(g, gu)
        err = ((res.double() - ref).norm() / ref.norm()).item()
        ms = do_bench(lambda: fn(g, gu), return_mode="median")
        out.append(f"{label:28s} {ms:6.3f} ms  {nbytes / ms / 1e9:6.2f} TB/s  rel err {err:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b", choices=sorted(sb.SHAPES))
    p.add_argument("--sections", default="swiglu,kernels,activations")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step: needs a CUDA device")
    torch._dynamo.config.recompile_limit = 64
    out: list[str] = [f"{torch.cuda.get_device_name(0)} torch={torch.__version__}"]
    print(out[0], flush=True)
    for name in args.sections.split(","):
        printed = len(out)
        try:
            {
                "kernels": kernels_section,
                "activations": activations_section,
                "swiglu": swiglu_section,
                "timeline": timeline_section,
            }[name](args, out)
        except Exception:  # noqa: BLE001 - keep the other sections
            out.append(f"{name} failed:\n{traceback.format_exc()}")
        print("\n".join(out[printed:]), flush=True)
        if args.out:
            (args.out / f"profile_{args.preset}.txt").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
