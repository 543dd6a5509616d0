"""What each method reads (issue 35 point 3; doremi/methods/registry.py `READS`): every method,
online or offline, declares it; no declaration reads the verdict's test half; a built method
whose `Needs` read more than its declaration is refused; the report lists it per method.

That the sweep runs (the offline fits' validation losses) and a method's probes and targets are
evaluated on the dev half at run time is tested in tests/test_validation_split.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.store.validation_split import CONSUMERS, MethodSplitError, split_for
from doremi.config import METHODS, OFFLINE_METHODS
from doremi.methods.registry import BUILDERS, READS, Reads, check_needs, check_reads, method_factory, reads
from doremi.reports.report import format_reads
from trainer.run.hooks import Alignment, Needs


def test_every_method_declares_what_it_reads():
    assert set(READS) == {*METHODS, *OFFLINE_METHODS} == {*BUILDERS, *OFFLINE_METHODS}
    assert {name: reads(name).describe() for name in READS} == {
        "doremi": "training batches' losses, reference losses",
        "doge": "training batches' losses, dev validation (method_target), per-domain gradients",
        "odm": "training batches' losses",
        "aioli": "dev validation (method_probe)",
        "ado": "training batches' losses",
        "regmix": "dev validation (sweep_run), a sweep's losses",
        "mixing_law": "dev validation (sweep_run), a sweep's losses",
    }


def test_every_declared_validation_read_is_of_the_dev_half():
    for name, declared in READS.items():
        assert all(split_for(c, "dev_test") == "dev" for c in declared.validation), name
    assert {c for d in READS.values() for c in d.validation} <= {c for c, half in CONSUMERS.items() if half == "dev"}


def test_a_declaration_reading_the_test_half_is_refused():
    with pytest.raises(MethodSplitError, match=r"^method peek: reads validation as 'verdict', which reads the 'test'"):
        check_reads("peek", Reads(validation=("verdict",)))
    with pytest.raises(MethodSplitError, match="not a known consumer"):
        check_reads("peek", Reads(validation=("everything",)))


def test_needs_beyond_the_declaration_are_refused():
    check_needs("aioli", Needs(validation=True))
    check_needs("doge", Needs(alignment=Alignment(weights=(1.0, 0.0), sequences=2)))
    check_needs("odm", Needs(draws="random"))
    with pytest.raises(MethodSplitError, match=r"method odm: reads method_probe beyond its declaration"):
        check_needs("odm", Needs(validation=True))
    with pytest.raises(MethodSplitError, match=r"method ado: reads method_target beyond"):
        check_needs("ado", Needs(alignment=Alignment(weights=(1.0, 0.0), sequences=2)))
    with pytest.raises(MethodSplitError, match=r"asks for the 'test' validation split"):
        check_needs("aioli", Needs(validation=True, validation_split="test"))


def test_built_methods_read_within_their_declaration(stores, tmp_path):
    """The online methods built as the trainer builds them (`method_factory`) pass the check."""
    from tests.method_context import method_context
    from tests.runs import config

    cfg = config(stores, tmp_path / "run", "mixing.aioli.rounds=1", "mixing.aioli.delta=1", "mixing.aioli.sweeps=1")
    ctx = method_context(
        Path(tmp_path), ["a", "b", "c"], 20, cfg.train.global_batch_size, cfg.data.seq_len, [1, 1, 1], is_main=False
    )
    for name in ("odm", "aioli", "ado"):
        hook = method_factory(name, cfg)(ctx)
        check_needs(name, hook.needs)


def test_the_report_lists_what_each_method_read():
    from doremi.reports.summary import method_reads

    got = method_reads(["doremi", "regmix", "ado-online"])
    assert got == {
        "doremi": "training batches' losses, reference losses",
        "regmix": "dev validation (sweep_run), a sweep's losses",
        "ado-online": "training batches' losses",
    }
    assert format_reads(got).splitlines()[:3] == [
        "| method | reads |",
        "|---|---:|",
        "| doremi | training batches' losses, reference losses |",
    ]
