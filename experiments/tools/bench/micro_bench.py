"""Candidate changes for the 1B step, each timed alone on the GPU before it goes into the model.

Sections (`--sections`, comma-separated):
- `attention`: one layer's attention core (RoPE, causal SDPA, the layout change back), forward
  and backward, compiled: the RoPE form before `trainer.model.ops.rope`, its torch ops and its
  Triton op; wall and kernel time per call, the top kernels, the largest differences.
- `norm`: the gradient's sums of squares over the 1B model's 99 gradient tensors:
  `_foreach_norm` against a two-launch Triton candidate over the pointer table.
- `boundary`: a block's last residual add and the next block's RMSNorm, as two compiled
  graphs against one.
- `update`: the AdamW update at the 1B sizes, inductor's flat kernel against the Triton kernel
  over per-parameter gradients for several block sizes and warps.

Usage (GPU, repository root): python experiments/tools/bench/micro_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_bench as sb  # noqa: E402

from trainer.model.layers import causal_attention, rope_tables  # noqa: E402
from trainer.model.ops.rope import rope_qkv, rope_qkv_torch  # noqa: E402

S, B, H, KV, HD, D, FFN, LAYERS, VOCAB = 2048, 8, 32, 8, 64, 2048, 8192, 16, 32000


def cuda_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def top_kernels(fn, n: int = 8) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [(k[:110], round(t, 4)) for k, t in rows[:n]]


def earlier_core(qkv, cos, sin):
    return causal_attention(*sb.earlier_rope_qkv(qkv, cos, sin, H, KV), "sdpa")


def torch_core(qkv, cos, sin):
    return causal_attention(*rope_qkv_torch(qkv, cos, sin, H, KV), "sdpa")


def op_core(qkv, cos, sin):
    return causal_attention(*rope_qkv(qkv, cos, sin, H, KV), "sdpa")


def attention(report: dict) -> None:
    """Wall time per call (host included: one layer is short enough for launch latency to show)
    and the kernels' own time (the profiler's CUDA total), which is what a step that the host
    runs ahead of pays."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cos, sin = rope_tables(S, HD, 500000.0, device=dev)
    qkv = torch.randn(S, B, (H + 2 * KV) * HD, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(S, B, H * HD, device=dev, dtype=torch.bfloat16)
    results = {}
    for name, core in (("earlier rope", earlier_core), ("rope_qkv torch ops", torch_core), ("rope_qkv op", op_core)):
        fn = torch.compile(core, dynamic=False)

        def step(fn=fn):
            qkv.grad = None
            out = fn(qkv, cos, sin)
            out.backward(grad)
            return out

        out = step()
        results[name] = (out.detach().clone(), qkv.grad.clone())
        fwd = torch.compile(core, dynamic=False)
        with torch.no_grad():
            fwd_ms = cuda_ms(lambda: fwd(qkv, cos, sin))
        ms = cuda_ms(step)
        kernels = top_kernels(step, n=100)
        rope_ms = sum(t for k, t in kernels if "cudnn" not in k and "Memset" not in k)
        report[f"attention {name}"] = {
            "fwd_bwd_ms": ms,
            "fwd_ms": fwd_ms,
            "kernel_ms": sum(t for _, t in kernels),
            "non_attention_kernel_ms": rope_ms,
            "kernels": kernels[:10],
        }
        print(
            f"attention {name}: fwd+bwd wall {ms:.3f} ms, fwd wall {fwd_ms:.3f} ms, kernels "
            f"{sum(t for _, t in kernels):.4f} ms of which not cuDNN {rope_ms:.4f} ms",
            flush=True,
        )
        for k, t in kernels[:10]:
            print(f"    {t:8.4f}  {k}", flush=True)
    (o0, g0), (o1, g1), (o2, g2) = results.values()
    report["attention diff"] = {
        "out": (o2 - o1).abs().max().item(),
        "grad": (g2 - g1).abs().max().item(),
        "out_scale": o1.abs().max().item(),
        "grad_scale": g1.abs().max().item(),
    }
    print("attention diff (op against torch ops)", report["attention diff"], flush=True)


def norm(report: dict) -> None:
    """The gradient's per-tensor sums of squares over 99 separate bf16 tensors at the 1B sizes
    (as autograd leaves them): `_foreach_norm` against `trainer.optim.multi_tensor.sums_of_squares`'s
    kernels for block sizes and warps; time per call."""
    import triton.language as tl

    from trainer.optim import multi_tensor as mt

    dev = torch.device("cuda")
    shapes = [(VOCAB, D)] + [(3072, D), (D, D), (2 * FFN, D), (D, FFN), (D,), (D,)] * LAYERS + [(D,), (VOCAB, D)]
    grads = [torch.randn(x, device=dev, dtype=torch.bfloat16) for x in shapes]
    numels = [g.numel() for g in grads]
    want = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()
    res = {
        "foreach_ms": cuda_ms(lambda: torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()),
        "sums_of_squares_ms": cuda_ms(lambda: mt.sums_of_squares(grads)),
    }
    block_squares, tensor_sums = mt.squares_kernels()
    for block in (4096, 8192, 16384):
        blocks = mt.TensorBlocks.build([0] * len(numels), numels, dev, block)
        partials = torch.empty(blocks.n_blocks, device=dev)
        out = torch.empty(len(numels), device=dev)
        for warps in (4, 8):

            def run(blocks=blocks, warps=warps, partials=partials, out=out):
                mt.launch(
                    block_squares,
                    blocks,
                    mt.tensor_pointers(grads, dev),
                    blocks.numels,
                    blocks.first_block,
                    partials,
                    DTYPE=tl.bfloat16,
                    num_warps=warps,
                )
                tensor_sums[(len(numels),)](partials, blocks.first_block, out, CHUNK=1024)
                return out

            res[f"triton_block{block}_warps{warps}_ms"] = cuda_ms(run)
            res[f"triton_block{block}_warps{warps}_rel_err"] = ((run() - want).abs() / want).max().item()
    report["norm"] = res
    print("norm (99 bf16 tensors, 1B sizes, ms)", res, flush=True)


def boundary(report: dict) -> None:
    dev = torch.device("cuda")
    a = torch.randn(S, B, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(S, B, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g1, g2 = torch.randn_like(a), torch.randn_like(a)
    add = torch.compile(lambda x, y: x + y, dynamic=False)
    nrm = torch.compile(lambda x, w: F.rms_norm(x, (D,), w, 1e-5), dynamic=False)
    both = torch.compile(lambda x, y, w: ((z := x + y), F.rms_norm(z, (D,), w, 1e-5)), dynamic=False)

    def two():
        z = add(a, r)
        n = nrm(z, w)
        torch.autograd.backward([z, n], [g1, g2])

    def one():
        z, n = both(a, r, w)
        torch.autograd.backward([z, n], [g1, g2])

    report["boundary"] = {"two_graphs_ms": cuda_ms(two), "one_graph_ms": cuda_ms(one)}
    print("boundary (fwd+bwd, one layer)", report["boundary"], flush=True)


def update(report: dict) -> None:
    """The AdamW update at the 1B model's tensor sizes: inductor's flat kernel against the Triton
    kernel over per-parameter gradients for block sizes and warps (and an fp32 copy: the
    attainable bandwidth)."""
    from trainer.optim.adamw_update import adamw_update, stacked_coefficients, triton_kernel
    from trainer.optim.multi_tensor import TensorBlocks, launch, tensor_pointers

    dev = torch.device("cuda")
    shapes = [(VOCAB, D)] + [(3072, D), (D, D), (2 * FFN, D), (D, FFN), (D,), (D,)] * LAYERS + [(D,), (VOCAB, D)]
    numels = [int(torch.Size(x).numel()) for x in shapes]
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += -(-n // 64) * 64
    m, v = (torch.zeros(at, device=dev) for _ in range(2))
    remainder = torch.zeros(at, device=dev, dtype=torch.int16)
    param = torch.zeros(at, device=dev, dtype=torch.bfloat16)
    grads = [torch.randn(n, device=dev, dtype=torch.bfloat16) for n in numels]
    flat_grad = torch.zeros(at, device=dev, dtype=torch.bfloat16)
    lr = torch.tensor(1e-4, dtype=torch.float64, device=dev)
    step = torch.tensor(3.0, dtype=torch.float64, device=dev)
    scale = torch.ones((), device=dev)
    flat = torch.compile(adamw_update, fullgraph=True, dynamic=False)
    res = {
        "flat_compiled_ms": cuda_ms(
            lambda: flat(remainder, flat_grad, m, v, param, lr, step, scale, at // 2, 0.9, 0.95, 1e-8, 0.1)
        ),
        "copy_fp32_ms": cuda_ms(lambda: m.copy_(v)),
        "bytes": at * 26,
    }
    coefficients = stacked_coefficients(lr, step, scale, 0.9, 0.95, 0.1)
    kernel = triton_kernel()
    for block, warps in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        blocks = TensorBlocks.build(offsets, numels, dev, block)

        def run(blocks=blocks, warps=warps):
            launch(
                kernel,
                blocks,
                tensor_pointers(grads, dev),
                blocks.offsets,
                blocks.numels,
                remainder,
                m,
                v,
                param,
                coefficients,
                at // 2,
                0.9,
                0.1,
                0.95,
                0.05,
                1e-8,
                ALIGN=blocks.align,
                num_warps=warps,
            )

        res[f"triton_block{block}_warps{warps}_ms"] = cuda_ms(run)
    report["update"] = res
    print("update (1B sizes, ms)", res, flush=True)


SECTIONS = {"attention": attention, "norm": norm, "boundary": boundary, "update": update}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    report: dict = {}
    for name in args.sections.split(","):
        try:
            SECTIONS[name](report)
        except Exception:
            traceback.print_exc()
            report[name] = {"error": traceback.format_exc(limit=3)}
    Path(args.out, "micro.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
