"""No host-device synchronisation inside a training step, checked on the CPU.

On a GPU a step must not wait for the device (docs/design.md section 7): reading a device value on
the host (`.item()`, `float(t)`, `bool(t)`), building a tensor from host data (`torch.tensor`,
a Python-list index such as `t[[2, 1]]`, which the H200 bench caught in the DoReMi update), or
an op whose output shape depends on the data (`nonzero`, boolean-mask indexing) all block the
host. They dispatch as the aten ops below, which a TorchDispatchMode sees on any device, so the
CPU suite can hold every phase of the step to zero of them: the reference forward, forward
and backward, the gradient syncs and the optimizer. (What does not dispatch, such as
`.tolist()` and `.cpu()`, the GPU bench counts with `torch.cuda.set_sync_debug_mode`.) A
method's `after_step` leaves its values on the device where its sampling does not need them
(DoReMi, DoGE): the loop reads them where it reads the device anyway, at its logging steps
(the last test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from doremi.pipeline import stages
from tests.runs import config
from trainer.config.fp8 import torchao_version
from trainer.optim.master_weights import MasterWeightAdamW
from trainer.records.metrics import read_jsonl
from trainer.run import loop
from trainer.run.loop import Trainer

#: aten ops that make the host wait for the device (or, for lift_fresh, copy host data to it).
HOST_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.lift_fresh",
    "aten.lift_fresh_copy",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
}
COMMON = ["train.decay=constant", "train.warmup_steps=0", "checkpoint.every=0"]


class HostSyncs(TorchDispatchMode):
    """Records the host-syncing ops run under it, with the phase they ran in."""

    def __init__(self):
        super().__init__()
        self.phase = ""
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        boolean_index = (
            name == "aten.index" and len(args) > 1 and any(i is not None and i.dtype == torch.bool for i in args[1])
        )
        if name in HOST_SYNC_OPS or boolean_index:
            self.seen.append((self.phase, name + (" (boolean index)" if boolean_index else "")))
        return func(*args, **kwargs)


def instrument(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> HostSyncs:
    """Run the step's phases under one HostSyncs mode; the rest of the step (sampling the
    batches on the host, logging after it) outside. torch.optim's own update is left out for
    fp32 parameters: on the CPU it is the foreach AdamW, which reads its step count on the host;
    on CUDA the trainer uses the fused kernel, which does not (the bench counts it there)."""
    mode = HostSyncs()

    def watched(phase: str, fn):
        def run(*args, **kwargs):
            if mode.phase:  # a phase called from another: keep the outer name
                return fn(*args, **kwargs)
            mode.phase = phase
            try:
                with mode:
                    return fn(*args, **kwargs)
            finally:
                mode.phase = ""

        return run

    monkeypatch.setattr(loop, "forward_backward", watched("forward_backward", loop.forward_backward))
    monkeypatch.setattr(loop, "domain_token_counts", watched("domain_token_counts", loop.domain_token_counts))
    monkeypatch.setattr(trainer.hook, "prepare_batches", watched("reference", trainer.hook.prepare_batches))
    phases = ["reduce_gradients", "clip_grad_norm", "zero_grad"]
    if isinstance(trainer.optimizer, MasterWeightAdamW):
        phases.append("step")
    for name in phases:
        monkeypatch.setattr(trainer.optimizer, name, watched(f"optimizer.{name}", getattr(trainer.optimizer, name)))
    return mode


def test_the_detector_sees_the_syncs_it_is_for():
    mode = HostSyncs()
    x = torch.arange(6.0).view(3, 2)
    with mode:
        x[[2, 1]], x.sum().item(), bool((x > 2).any()), x[x > 2], x.nonzero(), torch.stack([x[2], x[1]])
    assert [n for _, n in mode.seen] == [
        "aten.lift_fresh",
        "aten._local_scalar_dense",
        "aten._local_scalar_dense",
        "aten.index (boolean index)",
        "aten.nonzero",
    ]


PLAIN = {
    "fp32 params": [],
    "bf16 params": ["train.precision=bf16", "train.param_dtype=bf16"],
    "2 micro-batches, clip": ["train.micro_batches=2", "train.grad_clip=0.5"],
}


@pytest.mark.parametrize("sets", PLAIN.values(), ids=PLAIN.keys())
def test_plain_step(stores, tmp_path, monkeypatch, sets):
    trainer = Trainer(config(stores, tmp_path / "run", *COMMON, *sets))
    trainer.train_step()
    mode = instrument(trainer, monkeypatch)
    trainer.train_step()
    assert mode.seen == []


@pytest.fixture(scope="module")
def reference(stores, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sync") / "reference"
    stages.train_reference(config(stores, run, *COMMON))
    return run


PROXY = {
    "exact": [],
    "lagged": ["mixing.doremi.update=lagged"],
    "exact, 2 micro-batches": ["train.micro_batches=2"],
    "resample": ["mixing.doremi.mode=resample"],
    "bf16 params": ["train.precision=bf16", "train.param_dtype=bf16"],
    "bf16 compute, fp32 params": ["train.precision=bf16", "train.param_dtype=fp32"],
    **({"fp8 reference": ["mixing.doremi.reference_fp8=true"]} if torchao_version() else {}),
}


@pytest.mark.parametrize("sets", PROXY.values(), ids=PROXY.keys())
def test_doremi_proxy_step(stores, reference, tmp_path, monkeypatch, sets):
    trainer = stages.proxy_trainer(
        config(stores, tmp_path / "proxy", *COMMON, f"mixing.doremi.reference={reference}", *sets)
    )
    try:
        trainer.train_step()
        mode = instrument(trainer, monkeypatch)
        trainer.train_step()
    finally:
        trainer.hook.close()
    assert mode.seen == []


#: Host reads of a tensor that do not dispatch (the detector above cannot see them).
HOST_READS = ("tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__")


@pytest.mark.parametrize("method", ["doremi", "doge"])
def test_a_methods_step_end_leaves_its_values_on_the_device_until_the_loop_logs(
    stores, reference, tmp_path, monkeypatch, method
):
    """DoReMi's and DoGE's `after_step` read nothing on the host (their sampling needs no weights
    there): the trainer's metrics rows and `domain_weights.jsonl` get the values at the loop's
    logging steps, checkpoints and end, every step's line written once, in order."""
    run = tmp_path / "run"
    sets = [*COMMON, "train.steps=5", "logging.every=2", "checkpoint.every=3"]
    sets += [f"mixing.doremi.reference={reference}"] if method == "doremi" else ["mixing.method=doge"]
    trainer = stages.proxy_trainer(config(stores, run, *sets))
    assert trainer.hook.sampling_weights(1) is trainer.hook.sampling_weights(2)
    reads: list[tuple[int, str]] = []
    after, save = trainer.hook.after_step, trainer.save
    written: list[int] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def spy(step: int, name: str):
        def read(self, *args, **kwargs):
            reads.append((step, name))
            return originals[name](self, *args, **kwargs)

        return read

    def watched(step, signals):
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, spy(step, name))
        try:
            return after(step, signals)
        finally:
            for name, fn in originals.items():
                monkeypatch.setattr(torch.Tensor, name, fn)

    def saved():
        save()
        written.append(len(read_jsonl(run / "domain_weights.jsonl")))

    monkeypatch.setattr(trainer.hook, "after_step", watched)
    monkeypatch.setattr(trainer, "save", saved)
    trainer.fit()
    assert reads == []
    assert written == [3, 5]  # the checkpoint at step 3 and the last
    history = read_jsonl(run / "domain_weights.jsonl")
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 5]
    domains = history[0]["domains"]
    for row in logged:
        assert list(row["domain_weights"]) == domains
        assert list(row["domain_weights"].values()) == history[row["step"] - 1]["weights"]
        assert all(isinstance(t, int) for t in history[row["step"] - 1]["tokens"])


#: Each method's steps and settings for a short run (Aioli: one round longer than its probes).
HOST_READERS = {
    "odm": (3, []),
    "ado": (3, []),
    "aioli": (5, ["mixing.aioli.rounds=1", "mixing.aioli.delta=1", "mixing.aioli.sweeps=1"]),
}


@pytest.mark.parametrize("method", HOST_READERS)
def test_a_method_that_reads_its_losses_on_the_host_gets_them_queued_before_the_update(
    stores, tmp_path, monkeypatch, method
):
    """ODM's, ADO's and Aioli's `after_step` read the step's per-domain losses and tokens on the
    host every step: from `StepSignals.on_host`, whose copy the loop queued after the backward and
    before the optimizer's step (so the read waits for the backward alone). With the device
    tensors taken away before `after_step` the run is the same: each step's method log line and
    weights equal an untouched run's."""
    steps, extra = HOST_READERS[method]
    sets = [*COMMON, f"train.steps={steps}", f"mixing.method={method}", *extra]
    plain = tmp_path / "plain"
    trainer = stages.proxy_trainer(config(stores, plain, *sets))
    trainer.fit()
    run = tmp_path / "run"
    trainer = stages.proxy_trainer(config(stores, run, *sets))
    assert trainer.hook.needs.host_signals
    order: list[str] = []
    copy, step, after = loop.StepSignals.copy_to_host, trainer.optimizer.step, trainer.hook.after_step

    def copied(signals):
        order.append("copy")
        copy(signals)

    def stepped(*args, **kwargs):
        order.append("update")
        return step(*args, **kwargs)

    def after_step(n, signals):
        order.append("after_step")
        signals.loss_sum = signals.tokens = None  # only the host copies are left to read
        return after(n, signals)

    monkeypatch.setattr(loop.StepSignals, "copy_to_host", copied)
    monkeypatch.setattr(trainer.optimizer, "step", stepped)
    monkeypatch.setattr(trainer.hook, "after_step", after_step)
    trainer.fit()
    assert order == ["copy", "update", "after_step"] * steps
    assert read_jsonl(run / "domain_weights.jsonl") == read_jsonl(plain / "domain_weights.jsonl")
