"""What a weights file averaged from a DoReMi proxy records of the proxy's options: every option
that changes alpha_t (`SPEC.average_keys`), so that two files from proxies that differ only in,
say, an FP8 reference are told apart by their provenance (docs/design.md section 4)."""

import dataclasses
import json

import yaml

from doremi.methods.doremi import SPEC
from doremi.methods.doremi.config import DoReMiConfig
from doremi.pipeline import stages

#: The options that change no alpha_t: paths whose content the proxy's fingerprint holds (the
#: file's `sources`), what the reference trained on (read by `train-reference`, not the proxy),
#: and bookkeeping (`from_step` is recorded under its own name).
NOT_RECORDED = {"reference", "reference_cache", "reference_weights"} | set(SPEC.bookkeeping_options)


def fake_proxy(run, doremi: dict) -> None:
    """A proxy run directory as `doremi average` reads it: its config and a two-step history
    (no run record: a run made before headers is read unchecked)."""
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"mixing": {"method": "doremi", "doremi": doremi}}))
    rows = [
        {"step": 1, "domains": ["a", "b"], "weights": [0.25, 0.75], "tokens": [8, 8]},
        {"step": 2, "domains": ["a", "b"], "weights": [0.75, 0.25], "tokens": [8, 8]},
    ]
    (run / "domain_weights.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_weights_file_records_an_fp8_reference(tmp_path):
    fake_proxy(tmp_path / "fp8", {"eta": 1.0, "reference_fp8": True, "proxy_sampling": [0.5, 0.5]})
    doc = json.loads(stages.average(tmp_path / "fp8", tmp_path / "w.json").read_text())
    assert doc["reference_fp8"] is True
    assert doc["proxy_sampling"] == [0.5, 0.5]
    assert doc["weights"] == [0.5, 0.5] and doc["steps_averaged"] == 2


def test_every_option_that_changes_alpha_is_an_average_key():
    options = {f.name for f in dataclasses.fields(DoReMiConfig)}
    assert set(SPEC.average_keys) == options - NOT_RECORDED
    assert set(SPEC.average_keys) == {"eta", "smoothing", "update", "mode", "proxy_sampling", "reference_fp8"}


def test_from_step_is_checked_whoever_gives_it(tmp_path):
    """`--from-step` below 1 was taken as "every step"; it is refused as the config's key is."""
    import pytest

    from doremi.errors import DoReMiError

    fake_proxy(tmp_path / "p", {"eta": 1.0})
    for bad in (0, -5):
        with pytest.raises(DoReMiError, match=rf"^--from-step: expected an int >= 1, got {bad}$"):
            stages.average(tmp_path / "p", tmp_path / "w.json", from_step=bad)
    assert not (tmp_path / "w.json").exists()
    doc = json.loads(stages.average(tmp_path / "p", tmp_path / "w.json", from_step=2).read_text())
    assert doc["weights"] == [0.75, 0.25] and doc["from_step"] == 2
