"""What the model-feature benches share (fp8_bench, mamba_bench, moe_bench): the timer (CUDA
events on a GPU, wall clock elsewhere), one optimizer step of a whole single-process model timed
into a row with its MFU against the datasheet peak, and the output tail (parts that fail alone,
the result printed and written). A preset's model config is `trainer.config.schema.model_config`."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.schema import ModelConfig  # noqa: E402
from trainer.model.flops import flops_per_token  # noqa: E402

#: bf16 dense peak of an H100/H200 from the datasheet (FLOP/s), for MFU.
PEAK_BF16 = 989e12


def timed(fn: Callable[[], object], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of `steps` calls after `warmup` untimed ones (CUDA events on a GPU, so
    that a call's host syncs are part of its time and nothing else is)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        torch.cuda.synchronize()
        for i in range(steps):
            marks[i].record()
            fn()
        marks[-1].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def model_step_row(
    model: torch.nn.Module,
    cfg: ModelConfig,
    preset: str,
    micro_batch: int,
    seq: int,
    steps: int,
    warmup: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """The median time of a forward, backward and fused AdamW step of `model` (the mean token
    loss of one random micro-batch, under autocast to `dtype` when the parameters are fp32: bf16
    parameters run without it, as the trainer's `trainer.build._autocast`), its tokens/s and MFU
    (`trainer.model.flops.flops_per_token`: 6N + attention, and what the model's blocks add)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    fp32_params = next(model.parameters()).dtype == torch.float32
    use_autocast = dtype != torch.float32 and fp32_params

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=use_autocast):
            loss = model(None, batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    secs = sorted(timed(step, steps, warmup, device))
    median = secs[len(secs) // 2]
    tokens_per_s = seq * micro_batch / median
    fpt = flops_per_token(cfg, seq)
    return {
        "part": "step",
        "preset": preset,
        "ms": median * 1e3,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "mfu": tokens_per_s * fpt / PEAK_BF16,
    }


def add_model_args(ap, preset: str) -> None:
    """The arguments every single-model bench takes: the preset, the micro-batch, timing, device, --out."""
    ap.add_argument("--preset", default=preset)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)


def bench_args(
    ap: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """The parsed arguments, the device, and the dtype the trainer computes in there (bf16 on
    CUDA, fp32 elsewhere)."""
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def layer_and_step(
    bench_layer: Callable[..., list[dict]],
    bench_step: Callable[..., dict],
    cfg: ModelConfig,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    name: str,
) -> dict:
    """A feature bench's two parts (the layer alone, then one step of the whole model), each
    called with (cfg, args, device, dtype), through `run_parts`."""
    parts = {
        "layer": lambda: bench_layer(cfg, args, device, dtype),
        "step": lambda: [bench_step(cfg, args, device, dtype)],
    }
    return run_parts(parts, device, args.out, name)


def run_parts(parts: dict[str, Callable[[], list[dict]]], device: torch.device, out: Path | None, name: str) -> dict:
    """A bench's tail: each part through `run_part`, then the result {"device", "rows"} printed
    and, with `out`, written to `out/name`; exit status 1 when a part failed (after the earlier
    parts' rows are written), so that a queue sees the failure without losing the numbers."""
    rows: list[dict] = []
    ok = all([run_part(rows, part, fn) for part, fn in parts.items()])
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if device.type != "cuda":
        print("CPU: not a result (a smoke run of the script)")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    if not ok:
        raise SystemExit(1)
    return result


def run_part(rows: list[dict], part: str, fn: Callable[[], list[dict]]) -> bool:
    """Append `fn()`'s rows, or on an exception its traceback on stderr and one row
    {"part": part, "error": ...}, so that a crash in a later part of a bench (a step after its
    layer rows) still leaves the earlier parts' numbers in the output; False on an exception.
    The rows are also printed at once, one JSON line, so that the log holds them when a timeout
    kills the bench before it writes its result."""
    try:
        new = fn()
        rows.extend(new)
        print(json.dumps({"done": part, "rows": new}), flush=True)
        return True
    except Exception as e:  # noqa: BLE001 - keep the other parts' rows
        traceback.print_exc()
        rows.append({"part": part, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
        return False


def idle_gaps(busy: list[tuple[float, float]]) -> tuple[float, float, list[tuple[float, float]]]:
    """(span, idle, gaps) of the device's busy intervals [(start, end)] (any order, overlapping
    allowed, e.g. kernels on two streams): span from the first start to the last end, idle the
    part of it no interval covers, gaps those uncovered (start, end) stretches, longest first."""
    if not busy:
        return 0.0, 0.0, []
    spans = sorted(busy)
    gaps: list[tuple[float, float]] = []
    reach = spans[0][1]
    for start, end in spans[1:]:
        if start > reach:
            gaps.append((reach, start))
        reach = max(reach, end)
    span = reach - spans[0][0]
    gaps.sort(key=lambda g: g[0] - g[1])
    return span, sum(b - a for a, b in gaps), gaps


def gap_sizes(gaps: list[tuple[float, float]]) -> list[tuple[str, int, float]]:
    """(label, count, total) of the gaps by length in microseconds: launch-latency gaps (under
    20), host-bound stretches (20 to 200) and stalls (200 and more). Many small gaps mean the host
    launches more slowly than the GPU runs; a few long ones, a wait (a sync, an allocation)."""
    bins = [("< 20 us", 0.0, 20.0), ("20-200 us", 20.0, 200.0), (">= 200 us", 200.0, float("inf"))]
    out = []
    for label, lo, hi in bins:
        inside = [b - a for a, b in gaps if lo <= b - a < hi]
        out.append((label, len(inside), sum(inside)))
    return out


def profile_table(
    step: Callable[[], object], device: torch.device, rows: int, *, steps: int = 1, trace: Path | None = None
) -> str:
    """`steps` profiled calls of `step()` (already warm), back to back: their `rows` costliest ops
    by device time (self time, so that a kernel is not counted again under the op that launched
    it); on a GPU then where the GPU waited for the host (`idle_gaps` of the kernels' intervals:
    the idle total per step, the gaps by size, and the longest, each with its place in the span,
    the kernels either side and the host op running when it began), and the costliest ops by
    host time. A step's wall time above its kernels' sum is such waiting; this says where it is.
    Two steps show the gap between steps too (a host sync at a step's end exposes the next
    step's host work). `trace`: the profile as a gzipped Chrome trace (chrome://tracing,
    Perfetto) for the whole timeline."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(STEP_RANGE.format(i)):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace is not None:
        write_trace(prof, trace)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    if device.type != "cuda":
        return table
    try:
        lines = idle_lines(prof.events(), steps)
    except (AttributeError, TypeError, ValueError) as e:  # a profiler whose events lack the fields
        lines = [f"GPU idle: not computed ({type(e).__name__}: {e})"]
    by_host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=HOST_ROWS)
    return "\n".join([table, *lines, "", "by host time:", by_host])


def write_trace(prof, path: Path) -> None:
    """The profile's Chrome trace, gzipped, at `path` (a `.json.gz`)."""
    import gzip
    import shutil
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)


#: `profile_table`'s range around step i.
STEP_RANGE = "bench step {}"


def idle_lines(events, steps: int = 1) -> list[str]:
    """`profile_table`'s idle report from the profiler's events (kernels are CUDA events, host
    ops CPU events; each has `name`, `device_type.name` and `time_range.start`/`.end` in us).
    A `record_function` range shows on the device too (`is_user_annotation`; `profile_table`'s
    own are named `STEP_RANGE`) and covers a whole step: it is not work, and counted as such it
    hid every gap (the 16th session's profiles)."""
    ranges = {STEP_RANGE.format(i) for i in range(steps)}
    kernels = sorted(
        (
            (e.time_range.start, e.time_range.end, e.name)
            for e in events
            if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False) and e.name not in ranges
        ),
        key=lambda k: (k[0], k[1]),
    )
    host = [e for e in events if e.device_type.name == "CPU"]
    span, idle, gaps = idle_gaps([(a, b) for a, b, _ in kernels])
    per = f", {idle / steps / 1e3:.2f} ms a step" if steps > 1 else ""
    lines = [f"GPU idle: {idle / 1e3:.2f} ms of the kernels' {span / 1e3:.2f} ms span ({steps} step(s){per})"]
    lines.append(
        "  gaps by length: " + "; ".join(f"{label}: {n} ({total / 1e3:.2f} ms)" for label, n, total in gap_sizes(gaps))
    )
    lines.append("  longest (start in the span, length, kernel before -> kernel after, host op when it began):")
    origin = kernels[0][0] if kernels else 0.0
    for start, end in gaps[:GAPS_LISTED]:
        before = max((k for k in kernels if k[1] <= start), key=lambda k: k[1], default=None)
        after = min((k for k in kernels if k[0] >= end), key=lambda k: k[0], default=None)
        covering = [e for e in host if e.time_range.start <= start < e.time_range.end]
        inner = min(covering, key=lambda e: e.time_range.end - e.time_range.start, default=None)
        lines.append(
            f"  {(start - origin) / 1e3:9.3f} ms  {(end - start) / 1e3:7.3f} ms  "
            f"{_short(before[2] if before else '-')} -> {_short(after[2] if after else '-')}  "
            f"host: {inner.name if inner else '(no op)'}"
        )
    return lines


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


#: Gaps and host-time rows `profile_table` lists on a GPU.
GAPS_LISTED, HOST_ROWS = 12, 20
