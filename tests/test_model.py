"""The Llama model against a plain reference (experiments/tools/bench/plain_llama.py as a loop),
its layers, initialisation, parameter and FLOP counts. Single process, fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig, ParallelismConfig, RopeScaling
from trainer.config.tools import ConfigError
from trainer.model.flops import flops_per_token, non_embedding_params, param_count
from trainer.model.init import init_std
from trainer.model.layers import llama3_scaled_frequencies
from trainer.model.llama import Llama, build_stage, compile_scope
from trainer.model.ops.swiglu import swiglu
from trainer.parallel.context import ParallelContext


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


def _batch(cfg: ModelConfig, b: int = 2, s: int = 16, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels[0, :3] = -100
    labels[1, -1] = -100
    return {"input_ids": ids, "labels": labels}


# -- the reference: a plain loop Llama, independent of the model's code ------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_logits(p: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    V, D, H, KV = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    hd = D // H
    B, T = ids.shape
    emb = p["embed.weight"][:V]
    head = emb if cfg.tie_embeddings else p["head.weight"][:V]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(T).float(), inv)
    cos, sin = freqs.cos()[None, None], freqs.sin()[None, None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = emb[ids]
    for i in range(cfg.n_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        q, k, v = (_rms(x, w["attn_norm.weight"], cfg.norm_eps) @ w["attn.qkv.weight"].T).split(
            [H * hd, KV * hd, KV * hd], -1
        )
        q = _rope(q.view(B, T, H, hd).transpose(1, 2), cos, sin)
        k = _rope(k.view(B, T, KV, hd).transpose(1, 2), cos, sin).repeat_interleave(H // KV, dim=1)
        v = v.view(B, T, KV, hd).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, D) @ w["attn.out.weight"].T
        g, u = (_rms(x, w["mlp_norm.weight"], cfg.norm_eps) @ w["mlp.gate_up.weight"].T).chunk(2, -1)
        x = x + (F.silu(g) * u) @ w["mlp.down.weight"].T
    return _rms(x, p["norm.weight"], cfg.norm_eps) @ head.T


@pytest.mark.parametrize("tied,vocab,kv", [(False, 256, 2), (True, 256, 2), (False, 250, 4), (True, 250, 1)])
def test_matches_reference_logits_losses_and_grads(tied, vocab, kv):
    cfg = _cfg(tie_embeddings=tied, vocab_size=vocab, n_kv_heads=kv)
    model = Llama(cfg, seed=3)
    batch = _batch(cfg)
    ref_params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref = reference_logits(ref_params, cfg, batch["input_ids"])
    torch.testing.assert_close(model.logits(None, batch), ref, atol=1e-5, rtol=1e-5)

    losses = model(None, batch)
    assert losses.shape == (2, 16) and losses.dtype == torch.float32
    flat_labels = batch["labels"].reshape(-1)
    ref_losses = F.cross_entropy(ref.reshape(-1, vocab), flat_labels, reduction="none").view(2, 16)
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert torch.all(losses[batch["labels"] == -100] == 0)
    mean = losses.sum() / (batch["labels"] != -100).sum()
    torch.testing.assert_close(mean, F.cross_entropy(ref.reshape(-1, vocab), flat_labels), atol=1e-6, rtol=1e-6)

    w = torch.rand(2, 16, generator=torch.Generator().manual_seed(5))
    (losses * w).sum().backward()
    (ref_losses * w).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
    if vocab % 64:
        padded = model.embed.weight.grad[vocab:] if tied else model.head.weight.grad[vocab:]
        assert padded.shape[0] == 256 - vocab and torch.all(padded == 0)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_match_none(mode):
    cfg = _cfg(vocab_size=250)
    batch = _batch(cfg)
    results = []
    for m in ("none", mode):
        model = Llama(cfg, ParallelismConfig(recompute=m), seed=0)
        loss = model(None, batch)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=0)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, atol=1e-6, rtol=0, msg=name)


def test_full_recompute_keeps_only_block_input():
    cfg = _cfg()
    model = Llama(cfg, ParallelismConfig(recompute="full"), seed=0)
    block = model.layers["0"]
    x = torch.randn(16, 2, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        block(x, model.rope_cos[:16], model.rope_sin[:16])
    activations = [
        t
        for t in saved
        if t.untyped_storage().data_ptr() != model.rope_cos.untyped_storage().data_ptr()
        and t.untyped_storage().data_ptr() != model.rope_sin.untyped_storage().data_ptr()
    ]
    assert [t.data_ptr() for t in activations] == [x.data_ptr()]


def test_swiglu_saves_only_its_input_and_has_exact_grads():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 3, 10, generator=g, requires_grad=True)
    grad = torch.randn(4, 3, 5, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu(gate_up)
    assert len(saved) == 1 and saved[0] is gate_up
    (out * grad).sum().backward()
    x = gate_up.detach().clone().requires_grad_()
    gt, up = x.chunk(2, -1)
    ref = F.silu(gt) * up
    (ref * grad).sum().backward()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(gate_up.grad, x.grad, atol=1e-6, rtol=1e-6)


def test_llama3_rope_scaling_by_hand():
    # original 8192, low 1, high 4: wavelengths > 8192 divided by 8, < 2048 kept, 4096 in between:
    # smooth = (8192/4096 - 1) / 3 = 1/3, scale = (2/3)/8 + 1/3 = 5/12.
    inv = 2 * math.pi / torch.tensor([100.0, 4096.0, 20000.0], dtype=torch.float64)
    out = llama3_scaled_frequencies(inv, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(out / inv, torch.tensor([1.0, 5 / 12, 1 / 8], dtype=torch.float64))


def test_rope_scaling_changes_only_long_wavelengths():
    base, scaled = Llama(_cfg(rope_theta=500000.0)), Llama(_cfg(rope_theta=500000.0, rope_scaling=RopeScaling()))
    # head_dim 16: the highest frequency (position 1 -> angle 1 rad) is untouched, the lowest is not.
    assert base.rope_cos[1, 0] == scaled.rope_cos[1, 0]
    assert base.rope_cos[31, -1] != scaled.rope_cos[31, -1]


def test_tiny_preset_param_count_and_flops_by_hand():
    cfg = ModelConfig(**PRESETS["tiny"])
    # per layer: qkv 64*(4+2*2)*16 = 8192, out 64*64 = 4096, gate_up+down 3*64*128 = 24576, norms 128
    layer = 8192 + 4096 + 24576 + 128
    assert param_count(cfg) == 256 * 64 * 2 + 2 * layer + 64 == 106816
    assert non_embedding_params(cfg) == 2 * layer + 64 + 256 * 64 == 90432
    assert flops_per_token(cfg, 256) == 6 * 90432 + 6 * 2 * 64 * 256 == 739200
    assert param_count(cfg) == sum(p.numel() for p in Llama(cfg).parameters())
    tied = ModelConfig(**{**PRESETS["tiny"], "tie_embeddings": True})
    assert param_count(tied) == 106816 - 256 * 64 == sum(p.numel() for p in Llama(tied).parameters())
    assert flops_per_token(tied, 256) == 739200


def test_bench_preset_flops_matches_plain_llama_convention():
    cfg = ModelConfig(**PRESETS["bench-1b"])
    d, f, hd = 2048, 8192, 64
    layer = 2 * d + d * (32 + 2 * 8) * hd + d * d + 3 * d * f
    n_params = 32000 * d + 16 * layer + d + 32000 * d  # plain_llama: emb + blocks + norm + head
    assert flops_per_token(cfg, 2048) == 6 * (n_params - 32000 * d) + 6 * 16 * d * 2048


def test_initialisation_scheme():
    cfg = _cfg(n_layers=4, vocab_size=250)
    model = Llama(cfg, seed=7)
    params = dict(model.named_parameters())
    assert init_std("layers.0.attn.out.weight", cfg) == pytest.approx(0.02 / math.sqrt(8))
    assert init_std("layers.0.mlp.down.weight", cfg) == pytest.approx(0.02 / math.sqrt(8))
    assert init_std("layers.0.attn.qkv.weight", cfg) == 0.02
    assert init_std("norm.weight", cfg) is None
    assert torch.all(params["layers.3.mlp_norm.weight"] == 1)
    assert torch.all(params["embed.weight"][250:] == 0) and torch.all(params["head.weight"][250:] == 0)
    assert params["layers.0.mlp.gate_up.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.0.mlp.down.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    again = dict(Llama(cfg, seed=7).named_parameters())
    other = dict(Llama(cfg, seed=8).named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in params.items())
    assert not torch.equal(params["layers.0.attn.qkv.weight"], other["layers.0.attn.qkv.weight"])
    assert not torch.equal(params["layers.0.attn.qkv.weight"][:64], params["layers.1.attn.qkv.weight"][:64])


def test_stage_names_flags_and_shapes():
    cfg = _cfg(n_layers=3, tie_embeddings=True)
    par = ParallelismConfig(pp=3)
    stages = [build_stage(cfg, par, ParallelContext(pp=3, rank=r), range(r, r + 1), seed=0) for r in range(3)]
    names = [sorted(n for n, _ in s.named_parameters()) for s in stages]
    assert names[0] == sorted(["embed.weight", *(f"layers.0.{k}" for k in _BLOCK_KEYS)])
    assert names[1] == sorted(f"layers.1.{k}" for k in _BLOCK_KEYS)
    assert names[2] == sorted(["embed.weight", "norm.weight", *(f"layers.2.{k}" for k in _BLOCK_KEYS)])
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, True)]
    assert torch.equal(
        dict(stages[0].named_parameters())["embed.weight"], dict(stages[2].named_parameters())["embed.weight"]
    )
    assert stages[1].activation_shape(2, 16) == (16, 2, 64) and stages[1].activation_dtype == torch.float32

    batch = _batch(cfg)
    whole = Llama(cfg, seed=0)
    h = stages[1](stages[0](None, batch), batch)
    torch.testing.assert_close(stages[2](h, batch), whole(None, batch), atol=0, rtol=0)


_BLOCK_KEYS = [
    "attn_norm.weight",
    "attn.qkv.weight",
    "attn.out.weight",
    "mlp_norm.weight",
    "mlp.gate_up.weight",
    "mlp.down.weight",
]


def test_bad_layouts_are_one_line_errors():
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"parallelism.tp: expected a divisor of model.n_heads=4, got 3"):
        build_stage(cfg, ParallelismConfig(tp=3), ParallelContext(tp=3), range(2))
    with pytest.raises(ConfigError, match=r"layers range\(1, 5\)"):
        build_stage(cfg, ParallelismConfig(), ParallelContext.single(), range(1, 5))
    with pytest.raises(ValueError, match=r"max_seq_len=32"):
        Llama(cfg)(None, _batch(cfg, s=40))
    with pytest.raises(ValueError, match=r"'flash' needs CUDA"):
        Llama(_cfg(attention="flash"))
    with pytest.raises(ValueError, match=r"parallelism.recompute: expected one of none, selective, full, got 'all'"):
        Llama(cfg).layers["0"].recompute = "all"


def test_autocast_bf16_runs_and_keeps_fp32_grads():
    cfg = _cfg()
    model = Llama(cfg, seed=0)
    batch = _batch(cfg)
    ref = model(None, batch).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(None, batch)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, ref, atol=5e-2, rtol=0)
    losses.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_fused_loss_path_equals_vocab_parallel_one():
    """The tp = 1 compiled head uses F.cross_entropy; it must give the same losses and grads."""
    cfg = _cfg(vocab_size=250, tie_embeddings=True)
    batch = _batch(cfg)
    results = []
    for fused in (False, True):
        model = Llama(cfg, seed=0)
        model._fused_loss = fused
        losses = model(None, batch)
        losses.sum().backward()
        results.append((losses.detach(), model.embed.weight.grad))
    # fp32, summed in another order: a few ulps (the embedding's gradient reaches ~4, where one
    # ulp is 5e-7; which elements differ depends on the CPU's vector width).
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-6)


def test_compile_scope_and_set_recompute():
    """The whole stage is one graph at tp = 1 unless full recompute; per block otherwise; nothing
    without compile (or on the CPU). set_recompute sets every block and re-arranges."""
    assert compile_scope(True, 1, "none") == "stage" and compile_scope(True, 1, "selective") == "stage"
    assert compile_scope(True, 1, "full") == "blocks" and compile_scope(True, 2, "none") == "blocks"
    assert compile_scope(False, 1, "none") == "none"
    model = Llama(_cfg(), seed=0)
    assert not model._whole_graph and all(b._compiled is None for b in model.layers.values())
    model.set_recompute("full")
    assert {b.recompute for b in model.layers.values()} == {"full"}
    with pytest.raises(ValueError, match="parallelism.recompute"):
        model.set_recompute("most")
