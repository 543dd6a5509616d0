"""DoGE's one-pass kernels at a model's real parameter shapes, each alone (issue 35 item 5;
docs/design.md section 4c-iii): what each costs a step and what the next change would save,
measured before it is built.

Four parts, each a table:
- `gram`: `summed_gram` (the Gram of G's k + 1 rows summed over every parameter, one launch a
  parameter), its tuned launch and each launch choice (warps, pipeline stages, programs at
  most), two candidates beside it (the CUDA-core shift kernel of `gram_fma_triton.py` and cuBLAS
  over column slices), against one read of G by torch (`x.sum(dtype=float32)` per parameter: the bandwidth a
  read-once kernel can reach). The 15th session's step profile put the Gram at 10.9 ms a step at
  1B, about 1 TB/s, a third of the card's.
- `update`: `weighted_rows` (sum_d w_d G[d] per parameter) over `block` and warps.
- `norm`: one RMSNorm's backward in the one pass (`trainer::group_norm_backward`: dx with the
  residual stream's gradient and each group's weight sums, one read of dy and x) at its
  committed launch and each of `NORM_CHOICES`, against a plain step's compiled backward of the
  same norm.
- `dw`: each linear's per-group weight gradients for one micro-batch of B + T rows split into
  the run's groups, three ways: `rows` (sessions 14-15's form: one GEMM per row of [s, b, d]
  activations, read in place and summed by `addmm_`), `batch-major` (the committed op
  `trainer::group_weight_grads` on the one pass's batch-first activations: one GEMM per group
  over its contiguous [rows x s, d] block), `grouped_mm` (torch's grouped GEMM, one launch for
  every group, where the device takes it) and `plain` (one GEMM over all rows, K = b x s: the
  FLOPs' floor, plain's own weight gradient). Every form's result is checked against `rows`.

Each time is the median of `--reps` timed calls after one warm-up (CUDA events on a GPU, wall
clock elsewhere); a step's estimate multiplies a layer's time by the layers. The Triton parts
need CUDA; on the CPU only `dw` runs (the tests' check of the script).

Usage (repository root):
    python experiments/tools/bench/doge_kernels_bench.py [--preset bench-1b] [--rows 9]
        [--groups 2,2,2,2,1] [--parts gram,update,dw,norm] [--reps 5] [--out DIR] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer.config.schema import model_config  # noqa: E402
from trainer.model.llama import Llama  # noqa: E402
from trainer.run.group_grads import group_offsets, segment_grads  # noqa: E402

#: Launch choices `gram` times beyond the tuned launch: (warps, stages, programs at most).
GRAM_CHOICES = tuple(itertools.product((1, 2, 4), (2, 3, 4), (1024, 4096)))
#: Launch choices `update` times: (block, warps).
UPDATE_CHOICES = tuple(itertools.product((1024, 2048, 4096, 8192), (4, 8)))
#: Launch choices `norm` times: (tokens a program, elements a tile, warps).
NORM_CHOICES = tuple(itertools.product((16, 32, 64), (2048, 4096, 8192), (4, 8, 16)))
PARTS = ("gram", "update", "dw", "norm")


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of `reps` calls of `fn` after one warm-up call."""
    fn()
    cuda = device.type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parameter_shapes(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    """The preset's parameters (name, shape), from the model built on the meta device."""
    with torch.device("meta"):
        model = Llama(model_config(preset=preset))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def gradient_rows(shapes, rows: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One G [rows, numel] per parameter, random, as the one pass leaves them."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(rows, int(torch.Size(s).numel()), generator=gen, device=device).to(dtype) for _, s in shapes]


def gram_part(gs: list[torch.Tensor], reps: int, device: torch.device) -> list[dict[str, Any]]:
    from trainer.model.ops.skinny_products_triton import summed_gram, tuned_choices

    gb = sum(g.numel() * g.element_size() for g in gs) / 1e9
    out = []
    t = timed(lambda: [g.sum(dtype=torch.float32) for g in gs], reps, device)
    out.append({"form": "torch sum (one read)", "ms": t * 1e3, "GB/s": gb / t})
    reference = summed_gram(gs)
    t = timed(lambda: summed_gram(gs), reps, device)
    out.append({"form": "summed_gram, tuned", "ms": t * 1e3, "GB/s": gb / t, "choices": tuned_choices()})
    for warps, stages, programs in GRAM_CHOICES:
        kw = {"warps": warps, "stages": stages, "programs": programs}
        got = summed_gram(gs, **kw)
        t = timed(lambda kw=kw: summed_gram(gs, **kw), reps, device)
        err = float(((got - reference).abs().max() / reference.abs().max()).item())
        out.append({"form": "summed_gram", **kw, "ms": t * 1e3, "GB/s": gb / t, "rel_diff": err})
    from gram_fma_triton import shifted_gram

    for block_cols, warps in ((256, 4), (512, 4), (1024, 8)):
        got = shifted_gram(gs, block_cols=block_cols, warps=warps)
        t = timed(lambda b=block_cols, w=warps: shifted_gram(gs, block_cols=b, warps=w), reps, device)
        err = float(((got - reference).abs().max() / reference.abs().max()).item())
        form = f"CUDA-core shifts, {block_cols} columns a step"
        out.append({"form": form, "warps": warps, "programs": 1024, "ms": t * 1e3, "GB/s": gb / t, "rel_diff": err})
    for programs in (256, 1024):
        try:
            got = batched_gram(gs, programs)
        except (RuntimeError, TypeError) as e:  # a torch without bmm's fp32 output
            out.append({"form": f"bmm in {programs} slices", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        t = timed(lambda p=programs: batched_gram(gs, p), reps, device)
        err = float(((got - reference).abs().max() / reference.abs().max()).item())
        out.append({"form": f"bmm in {programs} slices", "ms": t * 1e3, "GB/s": gb / t, "rel_diff": err})
    return out


def batched_gram(gs: list[torch.Tensor], slices: int) -> torch.Tensor:
    """The summed Gram by cuBLAS: each G [r, n] cut into `slices` column slices (the tail apart)
    as one strided batched GEMM [slices, r, m] x [slices, m, r] with an fp32 output, summed in fp64:
    the batch gives cuBLAS the parallelism a single [r, n] x [n, r] GEMM lacks (the form before
    the Triton kernel ran at a tenth of the bandwidth)."""
    r = gs[0].shape[0]
    out = torch.zeros(r, r, dtype=torch.float64, device=gs[0].device)
    for g in gs:
        n = g.shape[1]
        m = n // slices
        if m:
            a = g[:, : m * slices].view(r, slices, m).transpose(0, 1)
            out += torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).sum(0, dtype=torch.float64)
        if n - m * slices:
            tail = g[:, m * slices :].float()
            out += (tail @ tail.t()).double()
    return out


def update_part(gs: list[torch.Tensor], k: int, reps: int, device: torch.device) -> list[dict[str, Any]]:
    from trainer.model.ops.skinny_products_triton import weighted_rows

    w = torch.rand(k, device=device).to(gs[0].dtype)  # the update's weights in G's dtype, as `_one_pass` rounds them
    # reads k rows, writes one
    gb = sum(g.shape[1] * g.element_size() * (k + 1) for g in gs) / 1e9
    out = []
    for block, warps in UPDATE_CHOICES:
        t = timed(lambda b=block, wp=warps: [weighted_rows(w, g[:k], block=b, warps=wp) for g in gs], reps, device)
        out.append({"form": "weighted_rows", "block": block, "warps": warps, "ms": t * 1e3, "GB/s": gb / t})
    return out


def norm_part(shapes, groups: list[int], seq: int, reps: int, device: torch.device) -> list[dict[str, Any]]:
    """One RMSNorm's backward at the model's width over the micro-batch's rows: the one pass's op
    (`trainer::group_norm_backward`: dx with the residual stream's gradient, each group's weight
    sums) at its committed launch and at each of `NORM_CHOICES`, against what a plain step pays
    for the same norm (the row-wise backward with the residual's add and the weight's sum over
    all tokens, compiled by inductor). A step's estimate multiplies by the norms."""
    from trainer.model.ops import group_norm_backward as nb

    d = next(s[0] for n, s in shapes if n.endswith("norm.weight"))
    norms = sum(1 for n, _ in shapes if n.endswith("norm.weight"))
    b = sum(groups)
    rows = torch.tensor([i for i, n in enumerate(groups) for _ in range(n)], device=device)
    gen = torch.Generator(device=device).manual_seed(2)
    x, dy, res = (torch.randn(b, seq, d, generator=gen, device=device).bfloat16() for _ in range(3))
    w = torch.randn(d, generator=gen, device=device).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    gb = 4 * x.numel() * x.element_size() / 1e9  # dy, x and the residual's gradient read, dx written

    @torch.compile
    def plain(dy, x, rstd, w, res):
        x_hat = x.float() * rstd
        g = dy.float() * w.float()
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) + res.float()
        return dx.to(x.dtype), (dy.float() * x_hat).sum((0, 1))

    def fused():
        return nb.group_norm_backward(dy, x, rstd, w, rows, len(groups), torch.float32, res)

    out = []
    t = timed(lambda: plain(dy, x, rstd, w, res), reps, device)
    out.append({"form": "plain (inductor)", "ms": t * 1e3, "step_ms": t * 1e3 * norms, "GB/s": gb / t})
    ref_dx, ref_dw = fused()
    t = timed(fused, reps, device)
    launch = {"tokens": nb.TOKENS, "tile": nb.TILE, "warps": nb.launch_shape(d)[2]}
    out.append({"form": "one pass, committed", **launch, "ms": t * 1e3, "step_ms": t * 1e3 * norms, "GB/s": gb / t})
    saved = (nb.TOKENS, nb.TILE, nb.WARPS)
    try:
        for tokens, tile, warps in NORM_CHOICES:
            nb.TOKENS, nb.TILE, nb.WARPS = tokens, tile, warps
            dx, dw = fused()
            err = max(
                float((dx.float() - ref_dx.float()).abs().max() / ref_dx.float().abs().max()),
                float((dw - ref_dw).abs().max() / ref_dw.abs().max()),
            )
            t = timed(fused, reps, device)
            out.append(
                {"form": "one pass", "tokens": tokens, "tile": tile, "warps": warps, "ms": t * 1e3,
                 "step_ms": t * 1e3 * norms, "GB/s": gb / t, "rel_diff": err}
            )  # fmt: skip
    finally:
        nb.TOKENS, nb.TILE, nb.WARPS = saved
    return out


def linear_shapes(shapes) -> dict[str, tuple[tuple[int, int], int]]:
    """Each kind of linear (the last name part before `weight`) -> ((out, in), how many)."""
    kinds: dict[str, tuple[tuple[int, int], int]] = {}
    for name, shape in shapes:
        if len(shape) != 2 or name.startswith("embed"):
            continue
        kind = name.split(".")[-2]
        prev = kinds.get(kind)
        kinds[kind] = (shape, (prev[1] if prev else 0) + 1)
    return kinds


def dw_part(
    shapes, groups: list[int], seq: int, dtype: torch.dtype, reps: int, device: torch.device
) -> list[dict[str, Any]]:
    b = sum(groups)
    labels = [i for i, n in enumerate(groups) for _ in range(n)]
    offsets = group_offsets(labels, len(groups))
    gen = torch.Generator(device=device).manual_seed(1)
    out = []
    for kind, ((n_out, n_in), count) in linear_shapes(shapes).items():
        g = torch.randn(seq, b, n_out, generator=gen, device=device).to(dtype)
        x = torch.randn(seq, b, n_in, generator=gen, device=device).to(dtype)
        g_bm, x_bm = g.transpose(0, 1).contiguous(), x.transpose(0, 1).contiguous()

        def rows():
            acc = torch.zeros(len(groups), n_out, n_in, dtype=dtype, device=device)
            for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
                for r in range(lo, hi):
                    acc[i].addmm_(g[:, r].t(), x[:, r])
            return acc

        def batch_major():
            return segment_grads(g_bm, x_bm, offsets, dtype)

        def plain():
            return torch.mm(g.reshape(-1, n_out).t(), x.reshape(-1, n_in))

        ends = torch.tensor([hi * seq for hi in offsets[1:]], dtype=torch.int32, device=device)

        def grouped():  # one launch for every group (torch's grouped GEMM, K split at the groups' ends)
            return torch._grouped_mm(g_bm.view(-1, n_out).t(), x_bm.view(-1, n_in), offs=ends)

        want = rows().float()
        scale = float(want.abs().max())
        diff = float((batch_major().float() - want).abs().max()) / scale
        plain_diff = float((plain().float() - want.sum(0)).abs().max()) / scale
        forms = [("rows", rows, 0.0), ("batch-major", batch_major, diff), ("plain", plain, plain_diff)]
        try:
            forms.append(("grouped_mm", grouped, float((grouped().float() - want).abs().max()) / scale))
        except (RuntimeError, TypeError, AttributeError) as e:  # not on this device, dtype or layout
            out.append(
                {"kind": kind, "shape": [n_out, n_in], "count": count, "form": "grouped_mm", "error": str(e)[:200]}
            )
        for form, fn, d in forms:
            t = timed(fn, reps, device)
            out.append(
                {
                    "kind": kind,
                    "shape": [n_out, n_in],
                    "count": count,
                    "form": form,
                    "ms": t * 1e3,
                    "step_ms": t * 1e3 * count,
                    "rel_diff": d,
                }
            )
    return out


def report(result: dict[str, Any]) -> str:
    lines = [
        "## DoGE's one-pass kernels alone (doge_kernels_bench.py)",
        "",
        f"Command: `{result['command']}`",
        f"Device: {result['device']}; torch {result['torch']}; {result['params']:,} parameters, "
        f"G of {result['rows']} rows in {result['dtype']}",
        "",
    ]
    if result.get("gram"):
        lines += [
            "### gram (every parameter, one step's worth)",
            "",
            "| form | warps | stages | programs | ms | GB/s | rel. diff |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["gram"]:
            if "error" in r:
                lines.append(f"| {r['form']} | | | | {r['error']} | | |")
                continue
            lines.append(
                f"| {r['form']} | {r.get('warps', '')} | {r.get('stages', '')} | "
                f"{r.get('programs', '')} | {r['ms']:.2f} | {r['GB/s']:.0f} | {r.get('rel_diff', 0.0):.1e} |"
            )
        chosen = next((r["choices"] for r in result["gram"] if r.get("choices")), None)
        if chosen:
            lines += [
                "",
                "The tuning's choices (key: warps, stages): " + "; ".join(f"{k}: {v}" for k, v in chosen.items()),
            ]
        lines.append("")
    if result.get("update"):
        lines += [
            "### update (every parameter, one step's worth)",
            "",
            "| block | warps | ms | GB/s |",
            "|---:|---:|---:|---:|",
        ]
        lines += [f"| {r['block']} | {r['warps']} | {r['ms']:.2f} | {r['GB/s']:.0f} |" for r in result["update"]]
        lines.append("")
    if result.get("dw"):
        lines += [
            f"### dw (groups {result['groups']}, s = {result['seq']})",
            "",
            "| linear | shape | per step | form | ms each | ms a step | rel. diff to rows |",
            "|---|---|---:|---|---:|---:|---:|",
        ]
        for r in result["dw"]:
            head = f"| {r['kind']} | {r['shape'][0]} x {r['shape'][1]} | {r['count']} | {r['form']} |"
            if "error" in r:
                lines.append(f"{head} {r['error']} | | |")
                continue
            lines.append(f"{head} {r['ms']:.3f} | {r['step_ms']:.2f} | {r['rel_diff']:.1e} |")
        totals: dict[str, float] = {}
        for r in (r for r in result["dw"] if "error" not in r):
            totals[r["form"]] = totals.get(r["form"], 0.0) + r["step_ms"]
        lines += ["", "A step's weight gradients: " + "; ".join(f"{f} {t:.2f} ms" for f, t in totals.items()), ""]
    if result.get("norm"):
        lines += [
            f"### norm (one RMSNorm's backward, groups {result['groups']}, s = {result['seq']})",
            "",
            "| form | tokens | tile | warps | ms each | ms a step | GB/s | rel. diff |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['form']} | {r.get('tokens', '')} | {r.get('tile', '')} | {r.get('warps', '')} | {r['ms']:.3f} | "
            f"{r['step_ms']:.2f} | {r['GB/s']:.0f} | {r.get('rel_diff', 0.0):.1e} |"
            for r in result["norm"]
        ]
        lines.append("")
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench-1b", help="model preset whose parameter shapes are used")
    p.add_argument("--groups", default="2,2,2,2,1", help="rows per group of the micro-batch (the target's last)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    if not parts or set(parts) - set(PARTS):
        p.error(f"expected --parts of {', '.join(PARTS)} (got {args.parts!r})")
    try:
        groups = [int(n) for n in args.groups.split(",")]
    except ValueError:
        groups = []
    if len(groups) < 2 or min(groups) < 0 or sum(groups) < 1:
        p.error(f"expected --groups of at least two row counts >= 0, got {args.groups!r}")
    if args.reps < 1 or args.seq < 1:
        p.error(f"expected --reps and --seq >= 1, got {args.reps} and {args.seq}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = parameter_shapes(args.preset)
    rows = len(groups)
    result: dict[str, Any] = {
        "command": "python experiments/tools/bench/doge_kernels_bench.py " + " ".join(argv or sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "params": sum(int(torch.Size(s).numel()) for _, s in shapes),
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "groups": groups,
        "seq": args.seq,
        "notes": [],
    }
    triton_parts = [x for x in parts if x in ("gram", "update", "norm")]
    if triton_parts and not cuda:
        result["notes"].append(f"{', '.join(triton_parts)}: skipped (the Triton kernels need CUDA here)")
    elif triton_parts:
        gs = gradient_rows(shapes, rows, dtype, device) if {"gram", "update"} & set(parts) else []
        if "gram" in parts:
            result["gram"] = gram_part(gs, args.reps, device)
        if "update" in parts:
            result["update"] = update_part(gs, rows - 1, args.reps, device)
        del gs
        torch.cuda.empty_cache()
        if "norm" in parts:
            result["norm"] = norm_part(shapes, groups, args.seq, args.reps, device)
    if "dw" in parts:
        result["dw"] = dw_part(shapes, groups, args.seq, dtype, args.reps, device)
    text = report(result)
    print(text, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "doge_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "doge_kernels.md").write_text(text)
    return result


if __name__ == "__main__":
    main()
