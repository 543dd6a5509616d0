"""The memorisation guardrail gates only beyond its own noise (doremi/reports/guardrails.py, issue 34):
gap - 2 SE > memorisation_gap warns; a gap above the limit but within 2 SE is an info."""

from __future__ import annotations

import pytest

from doremi.config import GuardrailConfig
from doremi.reports.guardrails import MEMORISATION_SES, beyond_noise, findings, measure, warnings

CFG = GuardrailConfig(memorisation_gap=0.05)


def _reference(gap: float, se: float | None) -> list[dict]:
    row = {"step": 10, "val_loss": {"a": 3.0}, "seen_loss": {"a": 3.0}, "heldout_loss": {"a": 3.0 + gap}}
    if se is not None:
        half = se / 2**0.5  # sqrt(se_seen^2 + se_held^2) = se
        row |= {"seen_loss_se": {"a": half}, "heldout_loss_se": {"a": half}}
    return [{"step": 10, "loss": 3.0, "epochs": {"a": 0.5}}, row]


def _memorisation(gap: float, se: float | None):
    return [
        f
        for f in findings(measure("reference-seed1", "reference", _reference(gap, se)), CFG)
        if f.check == "memorisation"
    ]


def test_beyond_noise_is_gap_minus_two_se():
    assert MEMORISATION_SES == 2.0
    assert beyond_noise(0.16, 0.05, 0.05) and not beyond_noise(0.15, 0.05, 0.05)
    assert beyond_noise(0.12, 0.04, 0.05, multiple=1.0) and not beyond_noise(0.12, 0.04, 0.05)


def test_a_gap_within_its_noise_does_not_warn():
    found = _memorisation(0.12, 0.05)  # 0.12 - 0.10 = 0.02 <= 0.05
    assert [(f.level, f.domain) for f in found] == [("info", "a")]
    assert found[0].message == (
        "reference-seed1: a: memorisation gap (heldout - seen loss) 0.12 ± 0.05 nats (standard error) "
        "> memorisation_gap 0.05 nats, within 2 standard errors: not a warning"
    )
    assert found[0].value == pytest.approx(0.12)


def test_a_gap_clearly_beyond_its_noise_warns():
    found = warnings(_memorisation(0.3, 0.05))  # 0.3 - 0.1 = 0.2 > 0.05
    assert [f.message for f in found] == [
        "reference-seed1: a: memorisation gap (heldout - seen loss) 0.3 ± 0.05 nats (standard error) "
        "> memorisation_gap 0.05 nats"
    ]


def test_without_a_standard_error_the_gap_is_compared_as_it_is():
    assert [f.level for f in _memorisation(0.12, None)] == ["warning"]
    assert _memorisation(0.04, 0.0) == []
