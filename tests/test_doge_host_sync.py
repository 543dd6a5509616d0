"""DoGE's aligned step (trainer/run/alignment.py) never waits for the device: a host sync per
domain drains the GPU's queue k times a step and leaves the launches of the next pass exposed
(tests/test_host_sync.py's detector; the host-side collation of each domain's and the target's
sequences is left out, as the plain step's is)."""

from __future__ import annotations

import pytest

import trainer.run.alignment as alignment
import trainer.run.loop as loop
from doremi.pipeline import stages
from tests.runs import config
from tests.test_host_sync import HostSyncs

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = ["train.precision=bf16", "train.param_dtype=bf16", "train.micro_batches=1"]
SETS = ["train.decay=constant", "train.warmup_steps=0", "train.lr=0.01", "train.grad_clip=0", "train.steps=1"]


class OffHost(HostSyncs):
    """HostSyncs, paused while `host` > 0 (inside the collation the test marks as host work)."""

    host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.host:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("one_pass", [False, True], ids=["k passes", "one pass"])
def test_the_aligned_step_does_not_wait_for_the_device(stores, tmp_path, monkeypatch, one_pass):
    """The k-pass step and the one-pass step (`mixing.doge.one_pass`, tests/test_doge_one_pass.py)."""
    mode = OffHost()

    def on_host(fn):
        def run(*args, **kwargs):
            mode.host += 1
            try:
                return fn(*args, **kwargs)
            finally:
                mode.host -= 1

        return run

    sets = [*SETS, *BF16, "mixing.method=doge", f"mixing.doge.one_pass={str(one_pass).lower()}"]
    trainer = stages.proxy_trainer(config(stores, tmp_path / "run", *sets))
    assert trainer.hook.needs.alignment.one_pass == one_pass
    monkeypatch.setattr(alignment, "collate", on_host(alignment.collate))
    monkeypatch.setattr(trainer.feed, "target_batches", on_host(trainer.feed.target_batches))
    step = alignment.aligned_step

    def watched(*args, **kwargs):
        with mode:
            return step(*args, **kwargs)

    monkeypatch.setattr(loop, "aligned_step", watched)
    trainer.fit()
    assert mode.seen == []
