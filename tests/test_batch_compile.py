"""The compiled model under changing batch sizes (trainer/model/batch_compile.py): static graphs
for the first `STATIC_SIZES` sizes, one graph with a symbolic batch dimension for every later one,
and the eager model's losses. On the CPU with a backend that counts graphs and runs them as traced (the
compiled model is built on CUDA only, so the test turns its compile on by hand)."""

from __future__ import annotations

import pytest
import torch

from tests.test_model import _batch, _cfg
from trainer.model.batch_compile import STATIC_SIZES, BatchCompiled
from trainer.model.llama import Llama


class Counting:
    """A dynamo backend that records each graph it is given and each run of one. One instance per
    `torch.compile` call, as inductor's are (their `dynamic` differs), so that the two compiled
    functions of a `BatchCompiled` keep separate cache entries as they do on the GPU."""

    def __init__(self, dynamic: bool | None, graphs: list, runs: list):
        self.dynamic, self.graphs, self.runs = dynamic, graphs, runs

    def __call__(self, gm: torch.fx.GraphModule, inputs: list):
        index = len(self.graphs)
        self.graphs.append(self.dynamic)

        def run(*args):
            self.runs.append(index)
            return gm.forward(*args)

        return run


@pytest.fixture
def counted(monkeypatch):
    """`torch.compile` with a `Counting` backend; gives (graphs, runs): per graph compiled its
    `dynamic` setting, per call the graph that ran."""
    import torch._dynamo

    real = torch.compile
    graphs: list = []
    runs: list = []
    monkeypatch.setattr(
        torch, "compile", lambda fn, dynamic: real(fn, backend=Counting(dynamic, graphs, runs), dynamic=dynamic)
    )
    torch._dynamo.reset()
    yield graphs, runs
    torch._dynamo.reset()


def test_batch_sizes_one_to_six_make_three_graphs_with_the_eager_losses(counted):
    graphs, _ = counted
    cfg = _cfg()
    eager, model = Llama(cfg, seed=0), Llama(cfg, seed=0)
    for m in (eager, model):
        m._fused_loss = True  # the tp = 1 head of a compiled model (LlamaStage.__init__)
    model._compiled = True  # as on CUDA: the whole stage one graph (compile_scope "stage")
    model.set_recompute("none")
    assert isinstance(model._run_compiled, BatchCompiled)
    full = _batch(cfg, b=6)
    for b in range(1, 7):
        batch = {k: v[:b] for k, v in full.items()}
        got, want = model(None, batch), eager(None, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"batch {b}")
        got.sum().backward()
        want.sum().backward()
    assert STATIC_SIZES == 2
    assert graphs == [False, False, None]  # batches 1 and 2 static; 3..6 one graph, the batch dimension symbolic
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, dict(eager.named_parameters())[name].grad, rtol=1e-5, atol=1e-5)


def test_the_first_sizes_keep_their_static_graphs_in_each_grad_mode(counted):
    """After the symbolic graph exists, the first sizes still run their static graphs; a batch of
    one reaching the symbolic function is dynamo's specialised 1 (a graph of its own); under
    `no_grad` (evaluation) the static sizes are counted apart, and the symbolic graph is its own."""
    graphs, runs = counted
    weight = torch.randn(4, 4, requires_grad=True)
    f = BatchCompiled(lambda x, w: (x @ w).relu().sum(-1), (0, None))
    for b in (4, 2, 4, 3, 5, 4, 6):
        out = f(torch.randn(b, 4), weight)
        assert out.shape == (b,)
    assert graphs == [False, False, None] and runs == [0, 1, 0, 2, 2, 0, 2]
    y = torch.randn(7, 4)
    assert f(y, weight).shape == (7,) and not hasattr(y, "_dynamo_dynamic_indices")  # the mark stays on a view
    f(torch.randn(1, 4), weight)
    assert graphs == [False, False, None, None] and runs[-2:] == [2, 3]
    with torch.no_grad():
        for b in (5, 4, 3, 2, 6):
            f(torch.randn(b, 4), weight)
    assert graphs[4:] == [False, False, None] and runs[-5:] == [4, 5, 6, 6, 6]  # grad mode is a guard
