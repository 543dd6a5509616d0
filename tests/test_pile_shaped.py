"""The Pile-shaped corpus generator (experiments/tools/pile_shaped.py, issue 42 point 5): The
Pile's 22 domains in its proportions, deterministic from a seed, and the pile config
(experiments/configs/pile_280m.yaml) preprocesses it with only its paths changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "experiments" / "tools" / "pile_shaped.py"
PILE_CONFIG = ROOT / "experiments" / "configs" / "pile_280m.yaml"

pytest.importorskip("zstandard")


ps = load_script(TOOL, "pile_shaped_tool")


def test_domain_sizes_follow_the_pile_papers_table():
    """Table 1 of the Pile paper: 825.18 GiB raw in all, Pile-CC 227.12 of it; the effective
    (raw x epochs) shares are the paper's "% of Pile" column (Pile-CC 18.11%, Enron 0.14%)."""
    raw = sum(r for _, _, r, _ in ps.PILE_TABLE)
    assert len(ps.PILE_TABLE) == 22 and raw == pytest.approx(825.18)
    effective = {n: r * e for n, _, r, e in ps.PILE_TABLE}
    total = sum(effective.values())
    assert total == pytest.approx(1254.20, abs=0.01)
    percent = {"pile_cc": 18.11, "pubmed_central": 14.40, "github": 7.59, "enron_emails": 0.14}
    for name, share in percent.items():  # the paper rounds from unrounded sizes: 14.395 -> 14.40
        assert 100 * effective[name] / total == pytest.approx(share, abs=0.006)
    sizes = ps.domain_bytes(825_180_000)
    assert sizes["pile_cc"] == 227_120_000 and sizes["enron_emails"] == 880_000


def test_the_same_seed_gives_the_same_bytes(tmp_path):
    a = ps.write_corpus(tmp_path / "a", 200_000, seed=3)
    b = ps.write_corpus(tmp_path / "b", 200_000, seed=3)
    c = ps.write_corpus(tmp_path / "c", 200_000, seed=4)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files) == 22 and a == b and c != a
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert (tmp_path / "a" / "pile_cc.jsonl.zst").read_bytes() != (tmp_path / "c" / "pile_cc.jsonl.zst").read_bytes()
    assert min(x.documents for x in a) == ps.MIN_DOCS  # enron_emails: 213 bytes asked


def _tokenizer(path: Path) -> None:
    from data.config import TokenizerConfig
    from data.sources.sources import read_embedded
    from data.tokenizer.tokenizer import build_tokenizer, save_tokenizer

    texts = read_embedded("docs") + read_embedded("code")
    save_tokenizer(build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=512), iter(texts)), path)


def test_the_pile_config_preprocesses_a_pile_shaped_corpus(tmp_path, capsys):
    """About 3 MB in 22 domains, zstd JSON lines with meta.pile_set_name (also in The Pile's own
    layout of mixed shards); `doremi preprocess` on the pile config, paths alone changed."""
    from data.sources.readers import open_binary
    from doremi.commands.cli import main

    corpus = tmp_path / "pile"
    counts = ps.write_corpus(corpus, 3_000_000, seed=0, shards=3)
    _tokenizer(tmp_path / "tokenizer.json")
    text = ps.rewrite_config(
        PILE_CONFIG.read_text(), corpus, tmp_path / "tokenizer.json", tmp_path / "stores", tmp_path / "runs"
    )
    original = PILE_CONFIG.read_text().splitlines()
    changed = [(a, b) for a, b in zip(original, text.splitlines()) if a != b]
    assert len(text.splitlines()) == len(original) and len(changed) == 22 + 3
    assert all("data/pile/" in a or "runs/pile" in a for a, _ in changed)
    (tmp_path / "pile.yaml").write_text(text)

    with open_binary(str(corpus / "enron_emails.jsonl.zst")) as f:
        assert json.loads(f.readline())["meta"] == {"pile_set_name": "Enron Emails"}
    shard_docs = 0
    for shard in sorted((corpus / "train").iterdir()):
        with open_binary(str(shard)) as f:
            shard_docs += sum(1 for _ in f)
    assert shard_docs == sum(c.documents for c in counts) == 3805

    assert main(["preprocess", str(tmp_path / "pile.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"stores in {tmp_path / 'stores'}: 22 domains"
    manifest = json.loads((tmp_path / "stores" / "manifest.json").read_text())
    by_name = {d["name"]: d for d in manifest["domains"]}
    assert list(by_name) == [name for name, _, _, _ in ps.PILE_TABLE]
    for c in counts:
        d = by_name[c.name]
        assert d["train"]["documents"] + d["validation"]["documents"] == c.documents
        assert d["train"]["bytes"] + d["validation"]["bytes"] == c.text_bytes
        assert d["validation"]["documents"] >= 1
    assert sum(c.text_bytes for c in counts) == 3_019_252


def test_the_piles_own_layout_splits_by_meta_pile_set_name(tmp_path):
    """`--shards`: the same documents in mixed shards, split by the domain column
    `meta.pile_set_name` (a field of the `meta` struct): 22 domains, the same counts."""
    from data.config import DataConfig
    from data.preprocess.preprocess import preprocess

    counts = ps.write_corpus(tmp_path / "pile", 300_000, seed=1, shards=2)
    cfg = DataConfig(
        dataset=[str(tmp_path / "pile" / "train" / "*.jsonl.zst")],
        domain_column="meta.pile_set_name",
        store_dir=str(tmp_path / "stores"),
        num_proc=1,
        validation_fraction=0.1,
    )
    manifest = preprocess(cfg, progress=False)
    docs = {d.name: d.train.documents + d.validation.documents for d in manifest.domains}
    nbytes = {d.name: d.train.bytes + d.validation.bytes for d in manifest.domains}
    assert list(docs) == sorted(c.pile_set_name for c in counts)
    assert docs == {c.pile_set_name: c.documents for c in counts}
    assert nbytes == {c.pile_set_name: c.text_bytes for c in counts}


TINY = {
    "model": {"vocab_size": 512, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64},
    "train": {"steps": 12, "global_batch_size": 22, "micro_batches": 1, "eval_every": 6, "eval_sequences": 22},
}


@pytest.mark.slow
def test_a_tiny_pipeline_runs_on_a_20_mb_pile_shaped_corpus(tmp_path, capsys):
    """Issue 42's CI version: 20 MB under the pile config (paths alone changed) preprocessed,
    then `doremi pipeline` with the model, training, layout and pipeline sections made tiny
    (the data and doremi sections kept, seq_len 64). About 70 s on 2 cores."""
    import yaml

    from doremi.commands.cli import main

    ps.write_corpus(tmp_path / "pile", 20_000_000, seed=0)
    _tokenizer(tmp_path / "tokenizer.json")
    text = ps.rewrite_config(
        PILE_CONFIG.read_text(), tmp_path / "pile", tmp_path / "tokenizer.json", tmp_path / "stores", tmp_path / "runs"
    )
    (tmp_path / "pile.yaml").write_text(text)
    assert main(["preprocess", str(tmp_path / "pile.yaml")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"stores in {tmp_path / 'stores'}: 22 domains"

    cfg = yaml.safe_load(text)
    cfg["model"] = {**TINY["model"], "max_seq_len": 64}
    cfg["data"] |= {"seq_len": 64, "num_proc": 1}
    cfg["train"] |= {**TINY["train"], "optimizer": "adamw"}
    cfg |= {"parallelism": {"dp": 1}, "checkpoint": {"every": 6, "keep": 1}, "logging": {"every": 6}}
    cfg["pipeline"] = {"run_dir": str(tmp_path / "runs"), "baselines": ["uniform"], "main": {"train": {"steps": 12}}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["pipeline", str(tmp_path / "tiny.yaml")]) == 0
    assert (tmp_path / "runs" / "report.md").is_file()
    assert "doremi " in capsys.readouterr().out
