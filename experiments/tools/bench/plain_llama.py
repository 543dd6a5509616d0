"""The plain PyTorch Llama training step that the framework's step is timed against.

Why a separate model: the bench asks how much the framework's own machinery (its layers, custom
ops, mixed-precision optimizer, DoReMi hooks) gains or costs against what a few dozen lines of
ordinary PyTorch get from the same GPU. So this file imports torch only, nothing from `trainer`,
`doremi` or `data`: no change to the framework can change the yardstick. Bench runs up to
2026-12-04 used an external copy of such a baseline; this one reproduces it bitwise (same
architecture, presets, initialisation order and FLOP convention; the check is in README.md).

The step: bf16 parameters, `torch.compile` of the whole model, per-token cross entropy averaged
over the micro-batch, backward, fused AdamW (lr 1e-4, torch's other defaults) on the bf16
parameters, gradients set to None. Random tokens.

Model: token embedding; per block, pre-norm attention (RMSNorm through `F.rms_norm`, one fused
[q | k | v] projection, rotate-half RoPE with theta 10000 whose cos/sin tables are cast to the
activation dtype, causal SDPA with grouped-query heads, output projection) and pre-norm SwiGLU
(one fused [gate | up] projection, silu(gate) * up, down projection); final RMSNorm; untied LM
head; no biases.

FLOPs per token = 6 * (every parameter except the input embedding, the LM head and the norms
included) + 6 * L * d * s (QK^T and AV, causal attention counted half as Megatron does).

Usage (on a GPU): python experiments/tools/bench/plain_llama.py [--preset 1b|280m|all] [--compile] [--steps N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

NORM_EPS = 1e-5
ROPE_THETA = 10000.0
LR = 1e-4


@dataclass(frozen=True)
class Shape:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    seq: int
    micro_batch: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


#: The framework's `bench-1b` and `bench-280m` presets are these shapes.
PRESETS = {
    "1b": Shape(vocab=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, seq=2048, micro_batch=8),
    "280m": Shape(
        vocab=32000, d_model=1024, n_layers=18, n_heads=16, n_kv_heads=16, ffn=2816, seq=1024, micro_batch=32
    ),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, NORM_EPS)


def rope_tables(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, 1, seq, head_dim / 2] in fp32, broadcast over [batch, heads]."""
    hd = shape.head_dim
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(shape.seq).float(), inv_freq)
    return angles.cos()[None, None], angles.sin()[None, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [batch, heads, seq, head_dim]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        d, hd = shape.d_model, shape.head_dim
        self.heads, self.kv_heads, self.hd = shape.n_heads, shape.n_kv_heads, hd
        self.attention_norm = nn.Parameter(torch.ones(d))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.wqkv = nn.Linear(d, (shape.n_heads + 2 * shape.n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w_gate_up = nn.Linear(d, 2 * shape.ffn, bias=False)
        self.w_down = nn.Linear(shape.ffn, d, bias=False)

    def split_heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """[b, s, n * hd] -> [b, n, s, hd], the layout SDPA takes."""
        b, s, _ = t.shape
        return t.view(b, s, n, self.hd).transpose(1, 2)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        widths = [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd]
        q, k, v = self.wqkv(x).split(widths, dim=-1)
        q = rotate(self.split_heads(q, self.heads), cos, sin)
        k = rotate(self.split_heads(k, self.kv_heads), cos, sin)
        v = self.split_heads(v, self.kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(rms_norm(x, self.attention_norm), cos, sin)
        return x + self.feed_forward(rms_norm(x, self.ffn_norm))


class Llama(nn.Module):
    """`Llama(shape)(ids, targets)` -> the mean cross entropy; `logits(ids)` -> [b, s, vocab].
    Modules are created in the order embedding, each layer's four projections, head, so that a
    seed gives the same weights as the external baseline."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.d_model)
        self.layers = nn.ModuleList(Layer(shape) for _ in range(shape.n_layers))
        self.final_norm = nn.Parameter(torch.ones(shape.d_model))
        self.output = nn.Linear(shape.d_model, shape.vocab, bias=False)
        cos, sin = rope_tables(shape)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        cos, sin = self.rope_cos.to(x.dtype), self.rope_sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(rms_norm(x, self.final_norm))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ids).float()
        return F.cross_entropy(logits.view(-1, self.shape.vocab), targets.view(-1))


def flops_per_token(shape: Shape) -> int:
    """Training FLOPs per token, counted from the model's own parameters (built on the meta
    device, so no memory)."""
    with torch.device("meta"):
        model = Llama(shape)
    matmul_params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    return 6 * matmul_params + 6 * shape.n_layers * shape.d_model * shape.seq


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def train_step(
    model: Llama, fwd: Callable[..., torch.Tensor], opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor
) -> None:
    fwd(ids, targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_step(
    name: str, device: torch.device, compile: bool = True, dtype: torch.dtype = torch.bfloat16
) -> tuple[Callable[[], None], int, int]:
    """Preset `name`'s training step on `device` (weights from seed 0, random tokens):
    (step, FLOPs per token, tokens per step)."""
    shape = PRESETS[name]
    torch.manual_seed(0)
    model = Llama(shape).to(device, dtype)
    opt = optimizer(model)
    fwd = torch.compile(model) if compile else model
    ids = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), device=device)
    targets = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), device=device)
    return (lambda: train_step(model, fwd, opt, ids, targets)), flops_per_token(shape), shape.micro_batch * shape.seq


def seconds_per_call(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * 8192**3 / seconds_per_call(lambda: a @ b, 10, 3) / 1e12


def report(name: str, compile: bool, steps: int, peak: float) -> str:
    step, fpt, tokens = make_step(name, torch.device("cuda"), compile)
    torch.cuda.reset_peak_memory_stats()
    tps = tokens / seconds_per_call(step, steps, 3)
    tflops = tps * fpt / 1e12
    shape = PRESETS[name]
    return (
        f"{name} mb={shape.micro_batch} seq={shape.seq} compile={compile} tokens/s={tps:,.0f} "
        f"TFLOP/s={tflops:.0f} MFU(989)={tflops / 989:.1%} MFU(measured {peak:.0f})={tflops / peak:.1%} "
        f"peak_mem={torch.cuda.max_memory_allocated() / 2**30:.1f}GiB"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    peak = matmul_peak_tflops()
    print(f"{torch.cuda.get_device_name(0)} torch={torch.__version__} bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    for name in PRESETS if args.preset == "all" else [args.preset]:
        print(report(name, args.compile, args.steps, peak), flush=True)


if __name__ == "__main__":
    main()
