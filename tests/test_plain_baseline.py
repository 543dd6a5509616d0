"""The bench's plain baseline (experiments/tools/bench/plain_llama.py) computes what the
framework's model computes, and counts FLOPs the same way, so that the bench's ratio compares
two implementations of one model. CPU, fp32, tiny shapes."""

from __future__ import annotations

import ast

import pytest
import torch

from tests.scripts import BENCH, bench_module
from trainer.config.presets import PRESETS
from trainer.config.schema import ModelConfig
from trainer.model.flops import flops_per_token
from trainer.model.llama import Llama


@pytest.fixture(scope="module")
def plain():
    return bench_module("plain_llama")


def framework_to_plain(name: str) -> str:
    """The framework's parameter name -> the baseline's."""
    top = {"embed.weight": "tok_embeddings.weight", "norm.weight": "final_norm", "head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)
    inner = {
        "attn_norm.weight": "attention_norm",
        "mlp_norm.weight": "ffn_norm",
        "attn.qkv.weight": "wqkv.weight",
        "attn.out.weight": "wo.weight",
        "mlp.gate_up.weight": "w_gate_up.weight",
        "mlp.down.weight": "w_down.weight",
    }
    return f"layers.{index}.{inner[rest]}"


def model_config(shape) -> ModelConfig:
    return ModelConfig(
        vocab_size=shape.vocab,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        ffn_dim=shape.ffn,
        max_seq_len=shape.seq,
    )


def test_plain_baseline_imports_only_torch_and_the_standard_library():
    tree = ast.parse((BENCH / "plain_llama.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"__future__", "argparse", "collections", "dataclasses", "time", "typing", "torch"}, roots


@pytest.mark.parametrize("vocab,kv_heads", [(256, 2), (250, 4)])
def test_same_weights_give_the_frameworks_logits_loss_and_gradients(plain, vocab, kv_heads):
    shape = plain.Shape(
        vocab=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn=96, seq=16, micro_batch=3
    )
    ours = Llama(model_config(shape), seed=5)
    theirs = plain.Llama(shape)
    theirs.load_state_dict(
        {
            framework_to_plain(n): p.detach()[:vocab] if n in ("embed.weight", "head.weight") else p.detach()
            for n, p in ours.named_parameters()
        }
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=g)
    labels = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=g)
    batch = {"input_ids": ids, "labels": labels}

    torch.testing.assert_close(theirs.logits(ids), ours.logits(None, batch), atol=1e-5, rtol=1e-5)
    plain_loss = theirs(ids, labels)
    framework_loss = ours(None, batch).mean()
    torch.testing.assert_close(plain_loss, framework_loss, atol=1e-5, rtol=1e-5)

    plain_loss.backward()
    framework_loss.backward()
    plain_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        grad = p.grad[:vocab] if name in ("embed.weight", "head.weight") else p.grad
        torch.testing.assert_close(plain_params[framework_to_plain(name)].grad, grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["1b", "280m"])
def test_presets_are_the_framework_bench_presets_with_the_same_flops(plain, name):
    shape = plain.PRESETS[name]
    cfg = ModelConfig(**PRESETS[f"bench-{name}"])
    assert model_config(shape) == cfg
    assert plain.flops_per_token(shape) == flops_per_token(cfg, shape.seq)


def test_train_step_moves_every_parameter(plain):
    shape = plain.Shape(vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn=48, seq=8, micro_batch=2)
    model = plain.Llama(shape)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq))
    opt = plain.optimizer(model)
    plain.train_step(model, model, opt, ids, ids)
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
