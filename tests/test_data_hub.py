"""Hub sources with a configuration name, a revision and streaming (issue 42 point 1), read
offline from a local dataset directory (a README.md declaring two configurations, as hub
datasets do); the revision is part of the stores' fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.config import DataConfig, DomainSource
from data.errors import DataError
from data.preprocess.preprocess import fingerprint, preprocess
from data.sources.sources import digest, plan_domains

datasets = pytest.importorskip("datasets")

README = """---
configs:
- config_name: small
  data_files:
  - split: train
    path: small/*.jsonl
- config_name: big
  data_files:
  - split: train
    path: big/*.jsonl
---
"""


@pytest.fixture
def hub_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    root = tmp_path / "dataset"
    for config, n in (("small", 4), ("big", 40)):
        (root / config).mkdir(parents=True)
        rows = [{"text": f"{config} document {i}: {'ünï ' * (i % 4)}", "id": i} for i in range(n)]
        (root / config / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "README.md").write_text(README)
    return root


def _cfg(tmp_path: Path, store: str, **hub) -> DataConfig:
    return DataConfig(
        domains=[DomainSource(name="web", hub=str(tmp_path / "dataset"), **hub)],
        store_dir=str(tmp_path / store),
        num_proc=1,
        validation_fraction=0.2,
    )


def test_streamed_and_downloaded_give_the_same_stores(tmp_path, hub_dir):
    """Configuration `big`, its first 25 documents: streamed (counted in a first pass) or
    loaded whole, the same bytes; the manifest names the configuration and revision."""
    streamed = _cfg(tmp_path, "streamed", hub_config="big", hub_revision="v1", hub_streaming=True, max_documents=25)
    loaded = _cfg(tmp_path, "loaded", hub_config="big", hub_revision="v1", max_documents=25)
    a, b = preprocess(streamed, progress=False), preprocess(loaded, progress=False)
    web = a.domain("web")
    assert (web.train.documents, web.validation.documents) == (20, 5)
    assert web.source == f"hub:{hub_dir}/big[train]@v1"
    assert a.fingerprint == b.fingerprint  # streaming does not change the bytes
    for name in ("web/train.bin", "web/train.idx", "web/validation.bin", "web/validation.idx"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "loaded" / name).read_bytes()
    small = preprocess(_cfg(tmp_path, "small", hub_config="small", hub_streaming=True), progress=False)
    assert small.domain("web").train.documents + small.domain("web").validation.documents == 4


def test_the_fingerprint_changes_with_the_revision_and_configuration(tmp_path):
    def fp(**hub) -> str:
        cfg = _cfg(tmp_path, "s", **hub)
        return fingerprint(cfg, plan_domains(cfg))

    prints = [
        fp(),
        fp(hub_revision="v1"),
        fp(hub_revision="v2"),
        fp(hub_config="big"),
        fp(hub_config="big", hub_revision="v1"),
    ]
    assert len(set(prints)) == 5
    assert fp(hub_revision="v1") == fp(hub_revision="v1", hub_streaming=True)
    common = {"text_field": "text", "max_documents": None, "sample_by": "document"}
    plain = plan_domains(_cfg(tmp_path, "s"))[0]  # unpinned: the fingerprint of before these keys
    assert plain.fingerprint == digest(["hub", str(tmp_path / "dataset"), "train", common])


def test_hub_keys_without_a_hub_dataset_are_refused(tmp_path):
    cfg = DataConfig(domains=[DomainSource(name="web", paths=["x.jsonl"], hub_revision="v1", hub_streaming=True)])
    with pytest.raises(DataError, match=r"^data.domains\[0\] \(web\): hub_revision, hub_streaming set without a hub"):
        cfg.validate()


def test_a_streamed_dataset_without_the_text_field_is_one_line(tmp_path, hub_dir):
    cfg = _cfg(tmp_path, "s", hub_config="small", hub_streaming=True)
    cfg.text_field = "body"
    with pytest.raises(DataError, match=r"^domain 'web': hub dataset .* have no field 'body' \(fields: text, id\)"):
        preprocess(cfg, progress=False)
    assert not (tmp_path / "s" / "manifest.json").exists()
