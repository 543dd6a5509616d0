"""Mixed-precision AdamW (trainer.optim.master_weights) against torch.optim.AdamW on fp32 copies."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.bf16 import rounded_half_away
from tests.interpreter import needs_triton, run_interpreted
from trainer.config.schema import TrainConfig
from trainer.optim.master_weights import MasterWeightAdamW, MasterWeightStateError
from trainer.parallel.context import ParallelContext

CFG = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


def _named(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("norm.weight", torch.nn.Parameter(torch.rand(5, generator=g) + 0.5)),
        ("a.weight", torch.nn.Parameter(torch.randn(4, 3, generator=g))),
        ("b.weight", torch.nn.Parameter(torch.randn(2, 6, generator=g))),
    ]


def _grads(step: int, named) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in named}


def _reference(named, steps: int, lrs: list[float], clip: float = 0.0) -> dict[str, torch.Tensor]:
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    opt = torch.optim.AdamW(
        [
            {"params": [ref[n] for n, p in named if p.ndim >= 2], "weight_decay": CFG.weight_decay},
            {"params": [ref[n] for n, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=CFG.lr,
        betas=(CFG.beta1, CFG.beta2),
        eps=CFG.eps,
        foreach=False,
    )
    for t in range(steps):
        for n, g in _grads(t, named).items():
            ref[n].grad = g.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), clip)
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        opt.step()
    return {n: p.detach() for n, p in ref.items()}


def _run(opt: MasterWeightAdamW, named, steps: range, lrs: list[float], clip: float = 0.0) -> list[torch.Tensor]:
    norms = []
    for t in steps:
        for n, g in _grads(t, named).items():
            dict(named)[n].grad = g.clone()
        opt.reduce_gradients()
        norms.append(opt.clip_grad_norm(clip))
        opt.step(lrs[t])
        opt.zero_grad()
    return norms


def test_split_and_join_hold_every_fp32_bit_and_round_half_away_from_zero():
    """Every low half under high halves at the edges (zeros, the smallest subnormal, 1 and its
    neighbour, the largest finite, whose upper half rounds to infinity, infinity, and their
    negatives): `join_fp32` gives back every bit `split_fp32` was given; the parameter is the
    round to nearest of the master, ties away from zero, so it differs from `.bfloat16()`
    (ties to even) exactly at the ties that round an even bf16 away."""
    from trainer.optim.adamw_update import join_fp32, split_fp32

    highs = torch.tensor([0x0000, 0x0001, 0x3F80, 0x3F81, 0x7F7F, 0x7F80], dtype=torch.int32)
    highs = torch.cat([highs, highs | -0x10000])  # the same with the sign bit set
    bits = ((highs[:, None] << 16) | torch.arange(1 << 16, dtype=torch.int32)).reshape(-1)
    bits = bits[~torch.isnan(bits.view(torch.float32))]
    master = bits.view(torch.float32)
    param, remainder = torch.empty(master.shape, dtype=torch.bfloat16), torch.empty(master.shape, dtype=torch.int16)
    split_fp32(master, param, remainder)
    assert torch.equal(join_fp32(param, remainder).view(torch.int32), bits)
    # Float ops flush subnormals once the trainer has run in this process (trainer.build), the
    # integer split never does: compare with them on the normal numbers.
    bits, master, param = (t[(bits & 0x7F800000) != 0] for t in (bits, master, param))
    assert torch.equal(param, rounded_half_away(master))
    tie = (bits & 0xFFFF) == 0x8000
    assert torch.equal(param[~tie], master[~tie].bfloat16())
    away_from_even = tie & ((bits >> 16) & 1 == 0)
    assert torch.equal(param != master.bfloat16(), away_from_even) and int(away_from_even.sum()) == 2
    assert torch.isinf(param[(bits >> 16) & 0x7FFF == 0x7F7F][-1])  # the largest finite's upper half


@pytest.mark.parametrize("micro_batches,compile", [(1, False), (2, False), (2, True)])
def test_matches_torch_adamw_on_fp32_master_and_params_are_its_bf16_rounding(micro_batches, compile):
    """One micro-batch (nothing sums): no main grads, the update reads `.grad` (per parameter
    here, on the CPU); two: fp32 main grads and the flat update, compiled (as on CUDA) or eager."""
    named = _named()
    expected = _reference(named, 3, [1e-2, 5e-3, 2e-3])
    cfg = TrainConfig(**{**CFG.__dict__, "micro_batches": micro_batches})
    opt = MasterWeightAdamW(named, cfg, ParallelContext.single(), compile=compile)
    assert all(p.dtype == torch.bfloat16 for _, p in named)
    if micro_batches == 1:
        assert opt.main_grad is None and opt._blocks is None
    else:
        assert opt.main_grad.dtype == torch.float32
    _run(opt, named, range(3), [1e-2, 5e-3, 2e-3])
    master = opt.master_weights()
    for n, p in named:
        torch.testing.assert_close(master[n], expected[n], rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), rounded_half_away(master[n]))
    assert opt.offsets == [0, 64, 128]  # a.weight, b.weight, norm.weight: 64-element aligned
    assert not opt.remainder[12:64].any() and not opt.exp_avg_sq[12:64].any() and not opt.flat_params[12:64].any()
    assert opt.remainder.dtype == torch.int16 and opt.remainder.numel() == 128 + 5


TRITON_CASE = textwrap.dedent("""
    import torch
    from tests.bf16 import rounded_half_away
    from trainer.optim import adamw_update as au
    from trainer.config.schema import TrainConfig
    from trainer.optim.master_weights import MasterWeightAdamW
    from trainer.parallel.context import ParallelContext

    assert au.uses_triton(torch.device("cpu")), "triton is not importable"
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, micro_batches=1)
    g = torch.Generator().manual_seed(0)
    # Tensors of more than one block and less, one that never gets a gradient (zero, as torch
    # is given below), matrices (decayed) around a vector (not).
    shapes = {"w1": (au.BLOCK + 37, 3), "norm": (5,), "w2": (2, 6), "unused": (7, 2)}
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.values() if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in ref.values() if p.ndim < 2], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = MasterWeightAdamW(named, cfg, ParallelContext.single())
    assert opt.main_grad is None and opt._blocks is not None
    blocks = opt._blocks  # w1, w2, unused, norm: w1's three whole blocks, then every tensor's partial one
    assert blocks.whole.tensor.tolist() == [0, 0, 0] and blocks.tails.tensor.tolist() == [0, 1, 2, 3]
    assert blocks.tails.start.tolist() == [3 * au.BLOCK, 0, 0, 0] and blocks.align == 64
    for t in range(3):
        grads = {n: torch.randn(p.shape, generator=g).bfloat16() for n, p in named if n != "unused"}
        for n, p in named:
            p.grad = grads[n].clone() if n in grads else None
            ref[n].grad = grads[n].float() if n in grads else torch.zeros_like(ref[n])
        norm = opt.clip_grad_norm(0.5)
        want = torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
        assert want > 0.5  # clipping is active
        opt.step(1e-2 / (t + 1))
        opt.zero_grad()
        for group in ref_opt.param_groups:
            group["lr"] = 1e-2 / (t + 1)
        ref_opt.step()
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    master = opt.master_weights()
    for n, p in named:
        torch.testing.assert_close(master[n], ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)
        assert torch.equal(p.detach(), rounded_half_away(master[n])), n
    print("ok")
""")


@needs_triton
def test_triton_update_on_autograd_grads_matches_torch_adamw_in_the_interpreter():
    """The Triton update over `.grad` tensors and the Triton gradient norm (the CUDA path), run by
    Triton's interpreter."""
    run_interpreted(TRITON_CASE)


def test_clipping_scales_the_gradient_and_reports_the_unclipped_norm():
    named = _named()
    expected = _reference(named, 2, [1e-2, 1e-2], clip=0.5)
    grads0 = _grads(0, named)
    want_norm = torch.cat([g.float().reshape(-1) for g in grads0.values()]).norm()
    opt = MasterWeightAdamW(named, CFG, ParallelContext.single())
    norms = _run(opt, named, range(2), [1e-2, 1e-2], clip=0.5)
    torch.testing.assert_close(norms[0], want_norm, rtol=1e-6, atol=0)
    assert norms[0].item() > 0.5
    master = opt.master_weights()
    for n, _ in named:
        torch.testing.assert_close(master[n], expected[n], rtol=1e-6, atol=1e-7)


def test_state_dict_resume_equals_uninterrupted_run():
    lrs = [1e-2, 8e-3, 6e-3, 4e-3]
    full_named = _named()
    full = MasterWeightAdamW(full_named, CFG, ParallelContext.single())
    _run(full, full_named, range(4), lrs)

    first_named = _named()
    first = MasterWeightAdamW(first_named, CFG, ParallelContext.single())
    _run(first, first_named, range(2), lrs)
    saved = {
        "kind": "adamw",
        "state": {n: {k: v.clone() for k, v in s.items()} for n, s in first.state_dict()["state"].items()},
    }
    assert set(saved["state"]["a.weight"]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert float(saved["state"]["a.weight"]["step"]) == 2.0

    resumed_named = _named(seed=7)  # different weights: the master must come from the state
    resumed = MasterWeightAdamW(resumed_named, CFG, ParallelContext.single())
    resumed.load_state_dict(saved)
    _run(resumed, resumed_named, range(2, 4), lrs)
    for (n, p), (_, q) in zip(full_named, resumed_named):
        assert torch.equal(full.master_weights()[n], resumed.master_weights()[n])
        assert torch.equal(p.detach(), q.detach())


def test_bad_state_and_config_are_one_line_errors():
    opt = MasterWeightAdamW(_named(), CFG, ParallelContext.single())
    named = dict(zip(opt.owned_names(), opt.params))
    with torch.no_grad():
        named["a.weight"].fill_(0.5)
    opt.refresh_master()
    assert torch.equal(opt.master_weights()["a.weight"], torch.full((4, 3), 0.5))
    with pytest.raises(MasterWeightStateError, match="no entry for parameter 'a.weight'"):
        opt.load_state_dict({"kind": "adamw", "state": {"norm.weight": {"step": torch.tensor(1.0)}}})
    bad = {
        n: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        for n in ("a.weight", "b.weight", "norm.weight")
    }
    with pytest.raises(
        MasterWeightStateError,
        match=r"'exp_avg' of parameter 'a.weight' has shape \(3,\), "
        r"the parameter is \(4, 3\)",
    ):
        opt.load_state_dict({"kind": "adamw", "state": bad})
    with pytest.raises(MasterWeightStateError, match="state is for 'adafactor'"):
        opt.load_state_dict({"kind": "adafactor", "state": {}})
    with pytest.raises(
        ValueError, match="train.optimizer: mixed-precision master weights support adamw, got 'adafactor'"
    ):
        MasterWeightAdamW(_named(), TrainConfig(optimizer="adafactor"), ParallelContext.single())


COMBINED_CASE = textwrap.dedent("""
    import torch
    from tests.combined_update_case import combined_against_written
    from trainer.optim import adamw_update as au
    from trainer.config.schema import TrainConfig
    from trainer.optim.master_weights import MasterWeightAdamW
    from trainer.parallel.context import ParallelContext

    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, micro_batches=1)
    shapes = {"w1": (au.BLOCK + 40, 3), "norm": (8,), "w2": (2, 8)}  # rows of whole 16-byte units

    def built():
        g = torch.Generator().manual_seed(0)
        named = [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]
        return MasterWeightAdamW(named, cfg, ParallelContext.single())

    def as_the_interpreter(weights, rows):  # sum_r w_r row_r in fp32, in row order, rounded once
        acc = torch.zeros(rows.shape[1:], dtype=torch.float32)
        for r in range(rows.shape[0]):
            acc = acc + weights[r].float() * rows[r].float()
        # to bf16 as the interpreter rounds (toward zero; a GPU to nearest even)
        return (acc.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()

    written, combined = built(), built()
    assert combined._blocks is not None
    by_id, weights, norm = combined_against_written(written, combined, shapes, as_the_interpreter, torch.device("cpu"), 3)
    # declined, and nothing taken, where the rows do not fit: a parameter missing, another dtype,
    # another shape, more than 16 rows, rows whose addresses are not 16-byte aligned
    odd = MasterWeightAdamW([("v", torch.nn.Parameter(torch.randn(5)))], cfg, ParallelContext.single())
    assert not odd.combine_gradients({id(odd.params[0]): torch.randn(3, 5).bfloat16()}, weights, norm.double())
    some = dict(list(by_id.items())[:2])
    wrong_dtype = {i: r.float() for i, r in by_id.items()}
    wrong_shape = {i: r[:2] for i, r in by_id.items()}
    many = {i: r[:1].expand(17, *r.shape[1:]).contiguous() for i, r in by_id.items()}
    for bad, w in ((some, weights), (wrong_dtype, weights), (wrong_shape, weights), (many, torch.ones(17).bfloat16())):
        assert not combined.combine_gradients(bad, w, norm.double())
        assert combined._combined is None
    print("ok")
""")


@needs_triton
def test_the_update_of_combined_gradients_equals_the_update_of_their_written_sum_in_the_interpreter():
    """`combine_gradients` (DoGE's one-pass update, never written): the Triton update summing
    each parameter's rows in its kernel gives bitwise the parameters, remainders and moments of
    the update of the sum written as `.grad` (fp32 in row order, rounded once to bf16), the
    clip with the norm handed over; rows that do not fit are declined."""
    run_interpreted(COMBINED_CASE)
