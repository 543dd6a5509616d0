"""`trainer.model.ops.cross_entropy` against F.cross_entropy in float64: the torch op (CPU) and the
Triton kernels (run by Triton's interpreter)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import needs_triton, run_interpreted
from trainer.model.ops.cross_entropy import cross_entropy, cross_entropy_op

IGNORE = -100


def _case(n: int, vocab: int, padded: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, padded, generator=g)).to(dtype)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::3] = IGNORE
    return logits, target, torch.randn(n, generator=g)


def _reference(logits, target, grad, vocab):
    z = logits.double()[:, :vocab].detach().requires_grad_()
    loss = F.cross_entropy(z, target, ignore_index=IGNORE, reduction="none")
    (dz,) = torch.autograd.grad(loss, z, grad.double())
    return loss, torch.cat([dz, torch.zeros(z.shape[0], logits.shape[1] - vocab, dtype=dz.dtype)], dim=1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_torch_op_matches_float64_reference_with_ignored_tokens_and_padded_vocab(dtype, tol):
    logits, target, grad = _case(7, 50, 64, dtype)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x.view(7, 1, 64), target.view(7, 1), 50, IGNORE)
    assert loss.shape == (7, 1) and loss.dtype == torch.float32
    (loss.view(-1) * grad).sum().backward()
    want_loss, want_grad = _reference(logits, target, grad, 50)
    torch.testing.assert_close(loss.view(-1).double(), want_loss, rtol=1e-6, atol=1e-6)
    assert not loss.view(-1)[::3].any()
    assert x.grad.dtype == dtype and not x.grad[:, 50:].any() and not x.grad[::3].any()
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=tol, atol=tol)
    torch.library.opcheck(cross_entropy_op, (logits, target, 50, IGNORE))


TRITON_CASE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from trainer.model.ops import cross_entropy as ce
    assert ce.triton_kernels() is not None, "triton is not importable"
    g = torch.Generator().manual_seed(0)
    # A vocabulary of more than one block with a ragged last one, one of less than a block,
    # padded columns, ignored tokens; fp32 and bf16 logits.
    for n, vocab, padded in ((5, 2 * ce.BLOCK + 37, 2 * ce.BLOCK + 64), (4, 100, 128)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            logits = (4 * torch.randn(n, padded, generator=g)).to(dtype)
            target = torch.randint(0, vocab, (n,), generator=g)
            target[1] = -100
            grad = torch.randn(n, generator=g)
            loss, lse = ce.cross_entropy_triton(logits, target, vocab, -100)
            want_loss, want_lse = ce.cross_entropy_torch(logits.double(), target, vocab, -100)
            assert loss.dtype == torch.float32 and loss[1] == 0
            torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
            d = ce.cross_entropy_backward_triton(grad, logits, target, lse, vocab, -100)
            want = ce.cross_entropy_backward_torch(grad.double(), logits.double(), target, want_lse, vocab, -100)
            assert d.dtype == dtype and not d[:, vocab:].any() and not d[1].any()
            err = ((d.double() - want).abs().max() / want.abs().max()).item()
            assert err < tol, (n, vocab, dtype, err)
    print("ok")
""")


@needs_triton
def test_triton_kernels_match_the_torch_op_in_the_interpreter():
    run_interpreted(TRITON_CASE)
