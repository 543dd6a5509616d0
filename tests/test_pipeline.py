"""Pipeline schedules against the unsplit model in one process (CPU, gloo, fp32).

A toy stage follows the Llama stage contract: embedding on the first stage, Linear+tanh blocks
split over stages, head and per-token cross entropy on the last stage. Every rank builds the
full toy model from one seed, runs it unsplit as the reference, and compares its own stage's
losses and gradients with it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from data.store.batch import IGNORE_INDEX
from tests.distributed import spawn
from trainer.feed.weighting import MeanTokenLoss
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import broadcast_from_last_stage, check_schedule, forward_only, train_schedule

VOCAB, WIDTH, LAYERS, BATCH, SEQ = 32, 16, 4, 2, 6
TOL = dict(rtol=1e-5, atol=1e-6)


class ToyModel(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, batch: dict) -> torch.Tensor:
        return ToyStage(self, range(LAYERS))(None, batch)


class ToyStage(nn.Module):
    """Blocks `layers` of a ToyModel; the stage contract of trainer/model/llama.py."""

    def __init__(self, full: ToyModel, layers: range):
        super().__init__()
        self.is_first, self.is_last = layers.start == 0, layers.stop == LAYERS
        self.blocks = nn.ModuleDict({str(i): full.blocks[str(i)] for i in layers})
        if self.is_first:
            self.embed = full.embed
        if self.is_last:
            self.head = full.head
        self.activation_dtype = torch.float32

    def activation_shape(self, batch_size: int, seq_len: int) -> tuple[int, ...]:
        return (batch_size, seq_len, WIDTH)

    def forward(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if self.is_first:
            hidden = self.embed(batch["input_ids"])
        for block in self.blocks.values():
            hidden = torch.tanh(block(hidden))
        if not self.is_last:
            return hidden
        logits = self.head(hidden)
        return F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view_as(batch["labels"])


class LossProportional:
    """Weights that depend on the whole step's forward losses (like DoReMi's alpha_t): token
    weight = its detached loss / the sum of all losses over the global batch."""

    needs_forward_losses = True

    def __init__(self, pc: ParallelContext | None = None, expected: int | None = None):
        self.pc, self.expected, self.weights = pc, expected, None

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        assert self.expected is None or len(losses) == self.expected, "prepare before all forwards"
        total = torch.stack([loss.sum() for loss in losses]).sum()
        if self.pc is not None and self.pc.dp > 1:
            dist.all_reduce(total, group=self.pc.dp_group)
        self.weights = [loss / total for loss in losses]

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        assert self.weights is not None, "backward before prepare"
        return self.weights[index]


def make_batches(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[0, :2] = IGNORE_INDEX
        out.append({"input_ids": ids[:, :-1], "labels": labels, "domain_ids": torch.tensor([0, 1])})
    return out


def global_tokens(batches: list[dict]) -> int:
    return int(sum((b["labels"] != IGNORE_INDEX).sum() for b in batches))


def reference(batches: list[dict], kind: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-token losses and summed gradients of the unsplit model over the global batch."""
    model = ToyModel()
    losses = [model(b) for b in batches]
    if kind == "mean":
        objective = sum(((b["labels"] != IGNORE_INDEX) * loss).sum() for b, loss in zip(batches, losses))
        objective = objective / global_tokens(batches)
    else:
        total = sum(loss.detach().sum() for loss in losses)
        objective = sum((loss.detach() / total * loss).sum() for loss in losses)
    objective.backward()
    return [loss.detach() for loss in losses], {n: p.grad for n, p in model.named_parameters()}


def stage_layers(pp: int, pp_rank: int) -> range:
    per = LAYERS // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def check_parity(pc: ParallelContext, schedule: str, kind: str, n_local: int) -> None:
    """Run the pipelined step on this rank's stage and dp shard; compare with the reference."""
    all_batches = make_batches(n_local * pc.dp, seed=7)
    local = all_batches[pc.dp_rank * n_local : (pc.dp_rank + 1) * n_local]
    ref_losses, ref_grads = reference(all_batches, kind)
    stage = ToyStage(ToyModel(), stage_layers(pc.pp, pc.pp_rank))
    weighting = MeanTokenLoss(global_tokens(all_batches)) if kind == "mean" else LossProportional(pc, expected=n_local)
    losses = train_schedule(stage, local, pc, schedule, weighting)
    if pc.is_last_stage:
        assert len(losses) == n_local
        for got, want in zip(losses, ref_losses[pc.dp_rank * n_local :]):
            torch.testing.assert_close(got, want, **TOL)
    else:
        assert losses == []
    for name, p in stage.named_parameters():
        grad = p.grad.clone()
        if pc.dp > 1:
            dist.all_reduce(grad, group=pc.dp_group)
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=f"{schedule} {kind} {name}")


def check_forward_only(pc: ParallelContext) -> None:
    batches = make_batches(3, seed=3)
    ref_losses, _ = reference(batches, "mean")
    stage = ToyStage(ToyModel(), stage_layers(pc.pp, pc.pp_rank))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        losses = forward_only(stage, batches, pc)
    assert saved == []
    assert all(p.grad is None for p in stage.parameters())
    if pc.is_last_stage:
        for got, want in zip(losses, ref_losses):
            assert not got.requires_grad
            torch.testing.assert_close(got, want, **TOL)
    else:
        assert losses == []


def check_broadcast(pc: ParallelContext) -> None:
    value = torch.tensor([1.5, 2.5]) if pc.is_last_stage else torch.zeros(2)
    got = broadcast_from_last_stage(value, pc)
    torch.testing.assert_close(got, torch.tensor([1.5, 2.5]), rtol=0, atol=0)


def _run_pp(rank: int, world: int, pp: int, dp: int, micro_batch_counts: list[int]) -> None:
    pc = ParallelContext.from_process_group(1, pp, dp, torch.device("cpu"))
    for n in micro_batch_counts:
        for schedule in ("1f1b", "afab"):
            check_parity(pc, schedule, "mean", n)
        check_parity(pc, "afab", "forward_losses", n)
    check_forward_only(pc)
    check_broadcast(pc)


def _run_pp4_then_pp2_dp2(rank: int, world: int) -> None:
    _run_pp(rank, world, 4, 1, [8, 4])
    _run_pp(rank, world, 2, 2, [3])


@pytest.mark.dist
def test_pp2_schedules_match_single_process():
    spawn(_run_pp, 2, 2, 1, [8, 5, 2])


@pytest.mark.dist
def test_pp4_and_pp2_dp2_schedules_match_single_process():
    spawn(_run_pp4_then_pp2_dp2, 4)


@pytest.mark.parametrize("schedule", ["1f1b", "afab"])
def test_pp1_is_plain_loop(schedule):
    pc = ParallelContext.single()
    check_parity(pc, schedule, "mean", 3)
    check_forward_only(pc)


def test_pp1_afab_with_forward_losses():
    check_parity(ParallelContext.single(), "afab", "forward_losses", 3)


def test_released_outputs_keep_backward_exact():
    """A stage output that its own last op saved (tanh) survives the release of its storage."""
    from trainer.parallel.pipeline_schedule import _backward_released, _release

    x = torch.randn(3, 4, requires_grad=True)
    out = torch.tanh(x * 2)
    want = torch.autograd.grad(torch.tanh(x * 2), x, torch.ones(3, 4))[0]
    pc = ParallelContext(pp=2)
    _release(out, pc)
    assert out.numel() == 1
    _backward_released(out, torch.ones(3, 4))
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_too_few_micro_batches():
    with pytest.raises(ValueError, match="pp=4 needs at least 4 micro-batches per step, got 3"):
        check_schedule(3, ParallelContext(pp=4), "1f1b", MeanTokenLoss(10))


def test_1f1b_refused_when_weights_need_forward_losses():
    with pytest.raises(ValueError, match="expected 'afab', got '1f1b'"):
        check_schedule(8, ParallelContext(pp=2), "1f1b", LossProportional())
    with pytest.raises(ValueError, match="expected 'afab', got '1f1b'"):
        train_schedule(ToyModel(), make_batches(2, 0), ParallelContext.single(), "1f1b", LossProportional())


def test_unknown_schedule():
    with pytest.raises(ValueError, match="expected one of 1f1b, afab, got 'gpipe'"):
        check_schedule(8, ParallelContext(pp=2), "gpipe", MeanTokenLoss(10))


# --- Llama stage parity (tp2 x pp2), once trainer/model/llama.py exists --------------------


def _llama_cfg():
    from trainer.config.schema import ModelConfig

    return ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)


def _llama_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 17), generator=g)
        labels = ids[:, 1:].clone()
        labels[1, -3:] = IGNORE_INDEX
        out.append({"input_ids": ids[:, :-1], "labels": labels, "domain_ids": torch.tensor([0, 1])})
    return out


def _run_llama_tp2_pp2(rank: int, world: int, sequence_parallel: bool) -> None:
    from trainer.config.schema import ParallelismConfig
    from trainer.model.llama import build_stage
    from trainer.parallel import tensor as tp_ops
    from trainer.parallel.shard import get_shard_spec, unshard
    from trainer.parallel.tied import sync_tied_grads

    cfg = _llama_cfg()
    batches = _llama_batches(4)
    n_tokens = global_tokens(batches)
    ref = build_stage(cfg, ParallelismConfig(), ParallelContext.single(), range(cfg.n_layers), seed=5)
    ref_losses = [ref(None, b) for b in batches]
    (sum(((b["labels"] != IGNORE_INDEX) * l).sum() for b, l in zip(batches, ref_losses)) / n_tokens).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    pc = ParallelContext.from_process_group(2, 2, 1, torch.device("cpu"))
    layers = range(0, 2) if pc.is_first_stage else range(2, 4)
    for schedule in ("1f1b", "afab"):
        par = ParallelismConfig(tp=2, pp=2, sequence_parallel=sequence_parallel, pp_schedule=schedule)
        stage = build_stage(cfg, par, pc, layers, seed=5)
        losses = train_schedule(stage, batches, pc, schedule, MeanTokenLoss(n_tokens))
        tp_ops.sync_sequence_parallel_grads(stage, pc)
        sync_tied_grads(stage, pc)
        if pc.is_last_stage:
            for got, want in zip(losses, ref_losses):
                torch.testing.assert_close(got, want.detach(), **TOL)
        for name, p in stage.named_parameters():
            spec = get_shard_spec(p)
            grad = p.grad
            if spec is not None:
                shards = [torch.empty_like(grad) for _ in range(pc.tp)]
                dist.all_gather(shards, grad.contiguous(), group=pc.tp_group)
                grad = unshard(shards, spec)
            want = ref_grads[name]
            torch.testing.assert_close(
                grad[tuple(slice(0, d) for d in want.shape)], want, **TOL, msg=f"{schedule} {name}"
            )


@pytest.mark.dist
def test_llama_tp2_pp2_matches_single_process():
    pytest.importorskip("trainer.model.llama")
    spawn(_run_llama_tp2_pp2, 4, True)
