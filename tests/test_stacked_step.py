"""The stacked step's efficiency pieces (issue 37 item 4, design section 4d-iii) change no number.

- the [M, b, s] activations: the M b sequences that RoPE and attention see are views, no copy;
- the fused head (`trainer.stacked.head`): losses and every gradient bitwise those of the
  unfused head (logits bmm, per-token cross entropy, autograd) on the CPU, for one chunk and for
  one model a chunk, tied or not, and so are those of `fused_head = False` (the bench's
  comparison); its in-place Triton loss gradient bitwise the kernels' own
  (Triton's CPU interpreter);
- stacked_bench's `--profile` prints the stacked step's costliest ops;
- one training step dispatches as many ops at 64 models as at 8 (no per-model launch: issue 37
  item 4), and each model's slice squares for the clip are the ordinary clip's, bitwise.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import trainer.stacked.head as head
import trainer.stacked.optim as stacked_optim
from tests.interpreter import needs_triton, run_interpreted
from tests.scripts import bench_module
from trainer.config.schema import ModelConfig
from trainer.optim import clip
from trainer.stacked.model import from_heads, stack_llamas, to_heads
from trainer.stacked.run import StackedRun


def test_heads_are_views_of_the_model_major_activations():
    x = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).view(3, 2, 5, 4)
    heads = to_heads(x)
    assert heads.shape == (5, 6, 4) and heads.data_ptr() == x.data_ptr()
    assert torch.equal(heads[4, 2 * 2 + 1], x[2, 1, 4])
    back = from_heads(heads, 3)
    assert back.is_contiguous() and back.data_ptr() == x.data_ptr() and torch.equal(back, x)


def test_models_per_chunk_fits_the_budget():
    assert head.CHUNK_BYTES == 4 * 2**30
    assert head.models_per_chunk(64, 4096, 4096, 2) == 64  # the bench's 2 GiB: one chunk
    assert head.models_per_chunk(512, 4096, 4096, 2) == 128
    assert head.models_per_chunk(64, 4096, 50304, 2) == 10
    assert head.models_per_chunk(3, 10, 10, 4) == 3
    assert head.models_per_chunk(4, 2**20, 2**12, 4) == 1


def _step(tie: bool, head_mode: str):
    cfg = ModelConfig(
        vocab_size=90, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
        attention="sdpa", tie_embeddings=tie,
    )  # fmt: skip
    model = stack_llamas(cfg, [1, 2, 3])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (3, 5, 13), generator=g)
    labels = torch.randint(0, 90, (3, 5, 13), generator=g)
    labels[0, 1, 3:] = -100
    weights = (labels != -100).float() * torch.tensor([0.5, 0.25, 2.0]).view(3, 1, 1)
    batch = {"input_ids": ids, "labels": labels}
    if head_mode != "plain":
        model.fused_head = head_mode == "fused"
        objective, losses = model(batch, weights)
        assert not losses.requires_grad
        assert objective.item() == pytest.approx((weights * losses).sum().item(), rel=1e-6)
        objective.backward()
    else:
        losses = model(batch)
        (weights * losses).sum().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("head_mode", "chunk_bytes"), [("fused", 2**25), ("fused", 1), ("unfused", 1)])
def test_fused_head_equals_the_unfused_head_bitwise(monkeypatch, tie, head_mode, chunk_bytes):
    losses, grads = _step(tie, "plain")
    monkeypatch.setattr(head, "CHUNK_BYTES", chunk_bytes)
    fused_losses, fused_grads = _step(tie, head_mode)
    assert torch.equal(fused_losses, losses)
    assert set(fused_grads) == set(grads)
    for name, g in grads.items():
        assert torch.equal(fused_grads[name], g), name


@needs_triton
def test_in_place_triton_loss_gradient_equals_the_kernels():
    run_interpreted(
        """
import torch
from trainer.stacked.head import _loss_and_grad
from trainer.model.ops.cross_entropy import cross_entropy_backward_triton, cross_entropy_triton
g = torch.Generator().manual_seed(0)
z = torch.randn(7, 2100, generator=g).to(torch.bfloat16)
t = torch.randint(0, 2000, (7,), generator=g)
t[2] = -100
w = torch.rand(7, generator=g)
loss, lse = cross_entropy_triton(z, t, 2000, -100)
dz = cross_entropy_backward_triton(w, z, t, lse, 2000, -100)
zc = z.clone()
fused_loss, fused_dz = _loss_and_grad(zc, t, w, 2000, -100)
assert torch.equal(fused_loss, loss) and torch.equal(fused_dz, dz)
assert fused_dz.data_ptr() == zc.data_ptr()
assert (fused_dz[2] == 0).all() and (fused_dz[:, 2000:] == 0).all()
print("ok")
"""
    )


@pytest.mark.parametrize("head_flag", [[], ["--unfused-head"]])
def test_stacked_bench_profile_prints_the_costliest_ops(capsys, head_flag):
    sb = bench_module("stacked_bench")
    args = "--models 2 --single 1 --d-model 32 --layers 1 --heads 2 --ffn 64 --vocab 128 --seq 16 --batch 2"
    sb.main([*args.split(), "--steps", "1", "--warmup", "1", "--device", "cpu", "--profile", "3", *head_flag])
    out = capsys.readouterr().out
    assert "Self CPU time total" in out and "Name" in out
    assert ("unfused head" if head_flag else "fused head") in out


def _step_ops(models: int) -> dict[str, int]:
    """The aten ops one warm training step of `models` stacked models dispatches (eager, CPU, the
    bench's step at a small shape)."""
    sb = bench_module("stacked_bench")
    args = sb.parse("--d-model 32 --layers 2 --heads 2 --ffn 64 --vocab 128 --seq 16 --batch 2 --device cpu".split())
    batches = sb.synthetic_batches(models, args, torch.device("cpu"))
    run = StackedRun(
        sb.bench_config(args), sb.SyntheticFeed(batches), list(range(models)), torch.device("cpu"), nullcontext()
    )
    run.train_step()
    return sb.op_counts(run.train_step)


def test_a_stacked_step_dispatches_as_many_ops_for_64_models_as_for_8(monkeypatch):
    """Every op covers all models at once: the count is the same at M = 8 and M = 64 (682 ops
    when written; a head launched model by model, or a clip over per-model slices, added ops in
    proportion to M: 1106 at 8 and 4578 at 64 before). One model a head chunk
    (CHUNK_BYTES = 1) shows that the count sees per-model launches."""
    eight, many = _step_ops(8), _step_ops(64)
    assert many == eight
    assert eight["aten::bmm"] == 2 * 4 * 3 + 3  # 4 projections a layer, forward and 2 backward; the head's 3
    monkeypatch.setattr(head, "CHUNK_BYTES", 1)
    per_model = _step_ops(64)["aten::bmm"]
    assert per_model == 2 * 4 * 3 + 3 * 64


def test_slice_squares_are_the_ordinary_clips_of_each_slice():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, *shape, generator=g) * 3 for shape in ((7, 33), (33,), (64, 9))]
    want = clip.squares([x[m] for m in range(5) for x in grads]).view(5, 3)
    assert torch.equal(stacked_optim.slice_squares(grads), want)


@needs_triton
def test_triton_slice_squares_are_the_kernels_on_each_slice():
    """The CUDA path (`sums_of_squares(rows=M)`: one launch, each row a tensor of the pointer
    table) in the interpreter: bitwise the kernels run on the slices one by one, as before; rows
    at unaligned addresses take the torch path."""
    run_interpreted(
        """
import torch
from trainer.optim import multi_tensor as mt
from trainer.stacked.optim import slice_squares
g = torch.Generator().manual_seed(0)
B = mt.SQUARES_BLOCK
grads = [torch.randn(3, *shape, generator=g) for shape in ((2, B + 4), (B,), (4,))]
assert mt.uses_triton_squares(grads, rows=3)
want = mt.sums_of_squares([x[m] for m in range(3) for x in grads]).view(3, 3)
assert torch.equal(slice_squares(grads), want)
odd = [torch.randn(3, 5, generator=g)]
assert not mt.uses_triton_squares(odd, rows=3)
assert torch.equal(slice_squares(odd), torch.stack(torch._foreach_norm(list(odd[0]), 2)).square().view(3, 1))
print("ok")
"""
    )
