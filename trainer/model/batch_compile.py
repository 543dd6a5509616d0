"""`torch.compile` for a model function whose batch size can change during a run.

Why: the model compiles with static shapes (`dynamic=False`), so a run whose micro-batches all
have one shape keeps its one specialised graph. But a method whose per-domain micro-batches change
shape from step to step (DoGE's per-domain gradients, a mixture regrouped by domain in
`trainer/run/alignment.py`) made dynamo compile a new graph per new batch size, and after
`torch._dynamo.config.recompile_limit` (8) fall back to eager silently, for the rest of the run.

`BatchCompiled` keeps static graphs, as before, for the first `STATIC_SIZES` batch sizes it
sees in each grad mode (a run of one micro-batch shape, an evaluation's last partial batch: the
graphs every GPU measurement so far ran), and runs every later size through a second compiled
function with the batch dimension marked dynamic: one more graph for all of them (docs/design.md
section 7a). The two are separate `torch.compile` calls with different `dynamic` settings, so
their compiled code sits in separate dynamo cache entries and the symbolic graph never shadows
the static ones. A batch of one is the exception: dynamo specialises sizes 0 and 1, so one
reaching the dynamic function compiles a graph of its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Batch sizes per grad mode that compile static graphs, as the model always did, before the
#: symbolic one takes the rest: a run of one shape, or of two (an evaluation's partial last
#: batch), keeps the exact graphs it had; only a run whose sizes keep changing gets the symbolic
#: graph. Per grad mode at most 2 static graphs, the symbolic one and dynamo's batch of one: 8 in
#: all for training and evaluation, dynamo's recompile limit for one function.
STATIC_SIZES = 2


def batch_size(args: Sequence[Any], batch_dims: Sequence[int | None]) -> int | None:
    """The batch size of the first tensor argument with a batch dimension (None: none given)."""
    for arg, dim in zip(args, batch_dims):
        if dim is not None and isinstance(arg, torch.Tensor):
            return int(arg.shape[dim])
    return None


class BatchCompiled:
    """`fn` compiled, its batch dimension dynamic after `STATIC_SIZES` batch sizes (module docstring).

    `batch_dims[i]`: the dimension of positional argument i that holds the batch ([s, b, d]
    activations: 1; [b, s] ids and labels: 0), None for an argument without one (RoPE tables);
    an argument passed as None is skipped."""

    def __init__(self, fn: Callable[..., Any], batch_dims: Sequence[int | None]):
        self.fn = fn
        self.batch_dims = tuple(batch_dims)
        self._static = torch.compile(fn, dynamic=False)
        self._varying = torch.compile(fn, dynamic=None)
        self._static_sizes: dict[bool, set[int]] = {}

    def __call__(self, *args: Any) -> Any:
        size = batch_size(args, self.batch_dims)
        if size is None:
            return self._static(*args)
        sizes = self._static_sizes.setdefault(torch.is_grad_enabled(), set())
        if size in sizes or len(sizes) < STATIC_SIZES:
            sizes.add(size)
            return self._static(*args)
        if size > 1:
            args = tuple(_marked(arg, dim) for arg, dim in zip(args, self.batch_dims, strict=True))
        return self._varying(*args)


def _marked(arg: Any, dim: int | None) -> Any:
    """`arg` as a view with its batch dimension `dim` marked dynamic. The mark stays on the
    tensor it is set on: set on the caller's own tensor, it would make another compiled function
    that later gets it (the head's, the reference model's, the static graph here) compile a
    symbolic graph, which then shadows its static one."""
    if dim is None or not isinstance(arg, torch.Tensor):
        return arg
    from torch._dynamo import mark_dynamic  # lazily: importing the trainer must not load dynamo

    view = arg.view_as(arg)
    mark_dynamic(view, dim)
    return view
