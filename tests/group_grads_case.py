"""DoGE's per-group gradients of one batch in two micro-batches, shared by the CPU test
(tests/test_doge_one_pass.py, fp64) and the CUDA check (tests/test_gpu.py, which runs without
pytest)."""

from __future__ import annotations

import torch

from trainer.run.group_grads import GroupGrads, group_offsets


def per_group_grads(model, named, batch: dict, w: torch.Tensor, k: int, split: int = 4) -> list[torch.Tensor]:
    """G_p [k, *p.shape] of every parameter: `batch` (rows sorted by group, `domain_ids`) cut
    after row `split` into two micro-batches, each announced and run forward and backward
    inside one `GroupGrads` block, the per-token loss weighted by `w` [b, s]."""
    halves = [{key: v[:split] for key, v in batch.items()}, {key: v[split:] for key, v in batch.items()}]
    with GroupGrads(model, named, k) as gg:
        for h in halves:
            gg.announce(h, group_offsets(h["domain_ids"].tolist(), k))
        for h, hw in zip(halves, (w[:split], w[split:])):
            (model(None, h) * hw).sum().backward()
    return gg.grads()
