"""Per-domain evaluation: token-weighted means, and the standard error over sequences that the
memorisation gap is judged with."""

import math

import torch

from tests.test_model import _batch, _cfg
from trainer.model.llama import Llama
from trainer.parallel.context import ParallelContext
from trainer.run.evaluate import evaluate_domains, evaluate_domains_with_error


def test_mean_and_standard_error_over_sequences():
    cfg = _cfg()
    model = Llama(cfg, seed=0)
    batches = [
        [_batch(cfg, b=3, seed=1), _batch(cfg, b=2, seed=2)],
        [{k: v[:1] for k, v in _batch(cfg, b=2, seed=3).items()}],
    ]
    pc = ParallelContext.single()
    mean, se = evaluate_domains_with_error(model, batches, pc)
    torch.testing.assert_close(mean, evaluate_domains(model, batches, pc), rtol=0, atol=0)
    with torch.no_grad():
        model.eval()
        per_token = [[model(None, b) for b in dom] for dom in batches]
    masks = [[b["labels"] != -100 for b in dom] for dom in batches]
    seq_means = [
        torch.cat([(l.double() * m).sum(-1) / m.sum(-1) for l, m in zip(ls, ms)]) for ls, ms in zip(per_token, masks)
    ]
    token_mean = sum((l * m).sum() for l, m in zip(per_token[0], masks[0])) / sum(m.sum() for m in masks[0])
    assert math.isclose(float(mean[0]), float(token_mean), rel_tol=1e-6)
    assert math.isclose(float(se[0]), float(seq_means[0].std() / math.sqrt(5)), rel_tol=1e-6)
    assert torch.isnan(se[1])  # one sequence: no spread to estimate


def test_partial_batches_are_padded_to_one_shape_and_their_losses_kept():
    """Each domain's last, partial batch is run at the full batch's shape (one compiled graph,
    no recompiles), and its real rows' losses are those of the unpadded forward."""
    from trainer.run.evaluate import evaluate_sequences

    cfg = _cfg()
    model = Llama(cfg, seed=0)
    one_row = {k: v[:1] for k, v in _batch(cfg, b=2, seed=2).items()}
    batches = [[_batch(cfg, b=3, seed=1), one_row], [_batch(cfg, b=2, seed=3)]]
    shapes = []
    forward = model.forward

    def recording(x, b):
        shapes.append(tuple(b["input_ids"].shape))
        return forward(x, b)

    model.forward = recording
    got = evaluate_sequences(model, batches, ParallelContext.single())
    assert set(shapes) == {(3, 16)} and len(shapes) == 3
    model.forward = forward
    with torch.no_grad():
        model.eval()
        for dom, (loss_sums, tokens) in zip(batches, got):
            want = torch.cat([(model(None, b).double() * (b["labels"] != -100)).sum(-1) for b in dom])
            assert len(loss_sums) == len(want) == len(tokens)
            torch.testing.assert_close(torch.from_numpy(loss_sums), want, rtol=1e-6, atol=0)
