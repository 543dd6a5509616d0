"""What DoGE's deferred step (trainer/run/alignment.py, docs/design.md section 4c) costs beside
its passes: the bookkeeping over the whole model's gradients (the norms, inner products, clips
and the weighted sum), held to no gradient copy and no pass that only clips, with the same
numbers as the released equations applied to the step's own gradients (here bf16 autograd
gradients, the layout of one GPU at one micro-batch that method_bench measures)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.run.alignment as alignment
import trainer.run.loop as loop
from doremi.methods.history import read_history
from doremi.pipeline import stages
from tests.runs import config
from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import attach_main_grad, grad_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_norm_and_dot_of_bf16_gradients_in_chunks(monkeypatch):
    """bf16 gradients give fp32-accurate <g, g> and <g, t> from one upcast of each chunk of g;
    fp32 ones the BLAS dots exactly; t is g gives the norm once."""
    gen = torch.Generator().manual_seed(0)
    g, t = (torch.randn(10_000, generator=gen).to(torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(alignment, "_DOT_CHUNK", 999)  # 11 chunks, the last of 10 elements
    sq, dot = alignment.fp32_norm_dot(g.view(100, 100), t.view(100, 100))
    assert sq.dtype == dot.dtype == torch.float64
    assert float(sq) == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)
    assert float(dot) == pytest.approx(float((g.double() * t.double()).sum()), rel=1e-6)
    same_sq, same_dot = alignment.fp32_norm_dot(g, g)
    assert float(same_sq) == float(same_dot) == float(alignment.fp32_dot(g, g)) == float(sq)
    f, u = g.float(), t.float()
    assert [float(x) for x in alignment.fp32_norm_dot(f, u)] == [float(torch.dot(f, f)), float(torch.dot(f, u))]
    empty = torch.zeros(0, dtype=torch.bfloat16)
    assert [float(x) for x in alignment.fp32_norm_dot(empty, empty)] == [0.0, 0.0]


def test_reduced_takes_autograd_gradients_and_copies_main_grads():
    """Autograd's gradients are kept as they are (the buffers drop them); a main grad, reset in
    place after each domain, and a tensor met twice are copied."""
    a, b, c = (torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(3))
    a.grad = torch.full((3,), 2.0, dtype=torch.bfloat16)
    b.grad = a.grad
    attach_main_grad(c, torch.full((3,), 4.0))
    grads = [a.grad, b.grad, c.main_grad]
    out = alignment._reduced(grads, [a, b, c], ParallelContext.single(torch.device("cpu")))
    assert out[0].data_ptr() == a.grad.data_ptr()
    assert out[1].data_ptr() != a.grad.data_ptr() and out[2].data_ptr() != c.main_grad.data_ptr()
    assert [x.tolist() for x in out] == [[2.0] * 3, [2.0] * 3, [4.0] * 3]


def test_clip_coefficient_is_clip_grad_norm_s():
    """c g equals `torch.nn.utils.clip_grad_norm_`'s clipped g (in fp64), c = 1 below the bound
    and without one."""
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    norm = torch.linalg.vector_norm(g)
    for max_norm, want in [(1.0, 1.0 / (5.0 + 1e-6)), (10.0, 1.0), (0.0, 1.0)]:
        assert float(alignment._clip_coef(norm, max_norm)) == want
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert (alignment._clip_coef(norm, 1.0) * g).tolist() == p.grad.tolist()


class _GradientOps(TorchDispatchMode):
    """Counts the ops of the aligned step outside the model's passes that touch a tensor of a
    parameter's size or more."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.inside, self.ops = size, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside:
            flat = [*args, *(kwargs or {}).values(), out]
            if any(isinstance(x, torch.Tensor) and x.numel() >= self.size for x in flat):
                name = func.overloadpacket.__name__
                self.ops[name] = self.ops.get(name, 0) + 1
        return out


BF16 = ["train.precision=bf16", "train.param_dtype=bf16", "train.micro_batches=1"]
#: micro-batches -> the gradients a pass leaves: autograd's bf16 ones at one, fp32 main grads at two.
LAYOUTS = {"bf16 autograd gradients": 1, "fp32 main grads": 2}
SETS = ["train.decay=constant", "train.warmup_steps=0", "train.lr=0.01", "train.grad_clip=0", "train.steps=1"]


@pytest.mark.parametrize("micro_batches", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_bf16_deferred_step_keeps_the_gradients_it_made_and_matches_the_equations(
    stores, tmp_path, monkeypatch, micro_batches
):
    """One deferred step of a bf16 model: the norms, inner products and update equal the
    released code's equations applied to the gradients its passes made, in fp64 (clip 1.8 binds
    for the target and one domain): to fp32 accumulation for the sums, and for the update to
    bf16 rounding of three multiply-adds (autograd's bf16 gradients, one micro-batch) or fp32
    rounding (fp32 main grads, two). With autograd's gradients they are kept without a copy (the
    update is written into the first domain's) and no op outside the passes clips or copies one."""
    clip = 1.8
    sets = [*SETS, *BF16, f"train.micro_batches={micro_batches}", "mixing.method=doge"]
    cfg = config(stores, tmp_path / "run", *sets, f"mixing.doge.domain_grad_clip={clip}")
    dtype = torch.bfloat16 if micro_batches == 1 else torch.float32
    trainer = stages.proxy_trainer(cfg)
    made: list[list[int]] = []  # each pass's gradient tensors (data pointers), then their values
    raw: list[list[torch.Tensor]] = []
    synced = alignment._synced_grads

    def recording(model, params, pc):
        grads = synced(model, params, pc)
        assert all(g.dtype == dtype for g in grads)
        made.append([g.data_ptr() for g in grads])
        raw.append([g.double() for g in grads])
        return grads

    monkeypatch.setattr(alignment, "_synced_grads", recording)
    smallest = min(p.numel() for _, p in trainer.named_params if p.dim() == 2)
    mode = _GradientOps(smallest)
    schedule = alignment.train_schedule

    def passes(*args, **kwargs):
        mode.inside += 1
        try:
            return schedule(*args, **kwargs)
        finally:
            mode.inside -= 1

    monkeypatch.setattr(alignment, "train_schedule", passes)
    step = alignment.aligned_step

    def watched(*args, **kwargs):
        with mode:
            return step(*args, **kwargs)

    monkeypatch.setattr(loop, "aligned_step", watched)
    written: dict[str, torch.Tensor] = {}
    written_at: list[int] = []
    reduce = trainer.optimizer.reduce_gradients

    def capture() -> None:
        written.update({n: grad_of(p).double() for n, p in trainer.named_params})
        written_at[:] = [grad_of(p).data_ptr() for _, p in trainer.named_params]
        reduce()

    trainer.optimizer.reduce_gradients = capture
    trainer.fit()
    assert len(made) == 4  # the target, then 3 domains
    if dtype == torch.bfloat16:
        assert written_at == made[1]
        big = sum(p.numel() >= smallest for _, p in trainer.named_params)
        assert not {"clone", "zeros_like", "div_"} & set(mode.ops) and mode.ops["mul_"] == big  # the first's w c

    def norm(g: list[torch.Tensor]) -> float:
        return math.sqrt(sum(float((x * x).sum()) for x in g))

    coef = [min(1.0, clip / (norm(g) + 1e-6)) for g in raw]
    assert min(coef) < 1.0 == max(coef)
    g_t = [x * coef[0] for x in raw[0]]
    per_domain = [[x * c for x in g] for g, c in zip(raw[1:], coef[1:])]
    row = read_history(tmp_path / "run")[0]
    want_alignment = [sum(float((a * t).sum()) for a, t in zip(g, g_t)) for g in per_domain]
    assert row["alignment"] == pytest.approx(want_alignment, rel=1e-6)
    assert row["grad_norm"] == pytest.approx([norm(g) for g in per_domain], rel=1e-6)
    alpha = row["weights"]
    for (name, _), *gs in zip(trainer.named_params, *per_domain):
        want = sum(a * g for a, g in zip(alpha, gs))
        scale = float(want.abs().max())
        atol = (3 * 2**-8 if dtype == torch.bfloat16 else 1e-6) * scale
        torch.testing.assert_close(written[name], want, rtol=0.0, atol=atol, msg=name)


def test_the_deferred_step_does_not_wait_for_the_device(stores, tmp_path, monkeypatch):
    """No host sync inside the aligned step (tests/test_host_sync.py's detector), the host-side
    collation of each domain's and the target's sequences left out as the plain step's is."""
    from tests.test_host_sync import HostSyncs

    class Paused(HostSyncs):
        host = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.host:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    mode = Paused()

    def on_host(fn):
        def run(*args, **kwargs):
            mode.host += 1
            try:
                return fn(*args, **kwargs)
            finally:
                mode.host -= 1

        return run

    trainer = stages.proxy_trainer(config(stores, tmp_path / "run", *SETS, *BF16, "mixing.method=doge"))
    monkeypatch.setattr(alignment, "collate", on_host(alignment.collate))
    monkeypatch.setattr(trainer.feed, "target_batches", on_host(trainer.feed.target_batches))
    step = alignment.aligned_step

    def watched(*args, **kwargs):
        with mode:
            return step(*args, **kwargs)

    monkeypatch.setattr(loop, "aligned_step", watched)
    trainer.fit()
    assert mode.seen == []
