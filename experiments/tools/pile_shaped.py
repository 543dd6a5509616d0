"""Write a Pile-shaped corpus: The Pile's 22 domains as zstd JSON lines, sized in The Pile's
proportions and scaled by one number, so that experiments/configs/pile_280m.yaml runs on it with
only its paths changed (issue 42 point 5):

    .venv/bin/python experiments/tools/pile_shaped.py --out /tmp/pile --total-mb 2000 \\
        --config-out /tmp/pile/pile_280m.yaml --tokenizer /tmp/pile/tokenizer.json
    .venv/bin/doremi preprocess /tmp/pile/pile_280m.yaml

Each domain is one file `<OUT>/<domain>.jsonl.zst`, named as the pile config names it, each line
`{"text": ..., "meta": {"pile_set_name": ...}}` as in The Pile's own files. With `--shards N` the
same documents are also written in The Pile's own layout, `<OUT>/train/00.jsonl.zst` ... (the
domains interleaved, one file set that `meta.pile_set_name` splits: the domain-column route).

Sizes: The Pile paper (Gao et al. 2020, "The Pile: An 800GB Dataset of Diverse Text for Language
Modeling", Table 1), raw size in GiB of each component as released (before its epochs are
applied); `--total-mb` is the UTF-8 bytes of text of all domains together, shared in those
proportions (each domain at least MIN_DOCS documents). The text is paragraphs of the embedded
quickstart corpus (data/corpus: Python code for `github`, prose and notes for the others),
each domain drawing from its own seeded subset so that domains differ; documents are 1-8
paragraphs. The same `--seed` and `--total-mb` give the same bytes (zstd level 3, one thread).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data.sources.sources import read_embedded  # noqa: E402

#: (config domain name, meta.pile_set_name, raw GiB, epochs): The Pile paper, Table 1. The
#: effective share (raw x epochs, the "% of Pile" column) is what The Pile trains on; the files
#: hold the raw documents.
PILE_TABLE: tuple[tuple[str, str, float, float], ...] = (
    ("pile_cc", "Pile-CC", 227.12, 1.0),
    ("pubmed_central", "PubMed Central", 90.27, 2.0),
    ("books3", "Books3", 100.96, 1.5),
    ("openwebtext2", "OpenWebText2", 62.77, 2.0),
    ("arxiv", "ArXiv", 56.21, 2.0),
    ("github", "Github", 95.16, 1.0),
    ("freelaw", "FreeLaw", 51.15, 1.5),
    ("stackexchange", "StackExchange", 32.20, 2.0),
    ("uspto_backgrounds", "USPTO Backgrounds", 22.90, 2.0),
    ("pubmed_abstracts", "PubMed Abstracts", 19.26, 2.0),
    ("gutenberg_pg_19", "Gutenberg (PG-19)", 10.88, 2.5),
    ("opensubtitles", "OpenSubtitles", 12.98, 1.5),
    ("wikipedia_en", "Wikipedia (en)", 6.38, 3.0),
    ("dm_mathematics", "DM Mathematics", 7.75, 2.0),
    ("ubuntu_irc", "Ubuntu IRC", 5.52, 2.0),
    ("bookcorpus2", "BookCorpus2", 6.30, 1.5),
    ("europarl", "EuroParl", 4.59, 2.0),
    ("hackernews", "HackerNews", 3.90, 2.0),
    ("youtubesubtitles", "YoutubeSubtitles", 3.73, 2.0),
    ("philpapers", "PhilPapers", 2.38, 2.0),
    ("nih_exporter", "NIH ExPorter", 1.89, 2.0),
    ("enron_emails", "Enron Emails", 0.88, 2.0),
)
CODE_DOMAINS = {"github"}
MIN_DOCS = 4  # a train and a validation document even in the smallest domain
MAX_PARAGRAPHS = 8
POOL_SHARE = 0.3  # each domain draws from its own 30% of the paragraphs
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class DomainCount:
    name: str
    pile_set_name: str
    documents: int
    text_bytes: int


def domain_bytes(total: int) -> dict[str, int]:
    """UTF-8 bytes of text per domain: `total` in proportion to the raw sizes (floor)."""
    raw = sum(r for _, _, r, _ in PILE_TABLE)
    return {name: int(total * r / raw) for name, _, r, _ in PILE_TABLE}


def _paragraphs() -> dict[str, list[str]]:
    def split(domains: list[str]) -> list[str]:
        return [p for d in domains for t in read_embedded(d) for p in t.split("\n\n") if p.strip()]

    return {"code": split(["code"]), "prose": split(["docs", "notes"])}


def documents(name: str, target: int, seed: int, pools: dict[str, list[str]]) -> Iterator[str]:
    """A domain's documents until `target` bytes of text (and at least MIN_DOCS documents)."""
    rng = random.Random(f"{seed}:{name}")
    pool = pools["code" if name in CODE_DOMAINS else "prose"]
    own = rng.sample(pool, max(1, int(len(pool) * POOL_SHARE)))
    written = docs = 0
    while written < target or docs < MIN_DOCS:
        text = "\n\n".join(rng.choices(own, k=rng.randint(1, MAX_PARAGRAPHS)))
        written += len(text.encode("utf-8"))
        docs += 1
        yield text


def _line(text: str, pile_set_name: str) -> bytes:
    return (json.dumps({"text": text, "meta": {"pile_set_name": pile_set_name}}, ensure_ascii=False) + "\n").encode()


def _zstd_writer(path: Path):
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0).stream_writer(open(path, "wb"), closefd=True)


def write_corpus(out: Path, total_bytes: int, seed: int = 0, shards: int = 0) -> list[DomainCount]:
    """`<out>/<domain>.jsonl.zst` per domain (and `--shards` files of all domains interleaved
    round-robin by document under `<out>/train/`); the counts per domain."""
    out.mkdir(parents=True, exist_ok=True)
    pools = _paragraphs()
    sizes = domain_bytes(total_bytes)
    shard_files = []
    if shards:
        (out / "train").mkdir(exist_ok=True)
        shard_files = [_zstd_writer(out / "train" / f"{i:02d}.jsonl.zst") for i in range(shards)]
    counts, k = [], 0
    try:
        for name, set_name, _, _ in PILE_TABLE:
            docs = nbytes = 0
            with _zstd_writer(out / f"{name}.jsonl.zst") as f:
                for text in documents(name, sizes[name], seed, pools):
                    line = _line(text, set_name)
                    f.write(line)
                    if shard_files:
                        shard_files[k % shards].write(line)
                        k += 1
                    docs += 1
                    nbytes += len(text.encode("utf-8"))
            counts.append(DomainCount(name, set_name, docs, nbytes))
    finally:
        for s in shard_files:
            s.close()
    return counts


_PATH = re.compile(r"data/pile/(\w+)\.jsonl\b")


def rewrite_config(text: str, corpus: Path, tokenizer: Path, store_dir: Path, run_dir: Path) -> str:
    """The pile config with its paths alone changed: each domain's file to the generated
    `.jsonl.zst`, the tokenizer, the store and run directories."""
    text, n = _PATH.subn(lambda m: f"{corpus}/{m.group(1)}.jsonl.zst", text)
    if n != len(PILE_TABLE):
        raise ValueError(f"expected {len(PILE_TABLE)} data/pile/<domain>.jsonl paths in the config, found {n}")
    replacements = {
        "path: data/pile/tokenizer.json": f"path: {tokenizer}",
        "store_dir: runs/pile/stores": f"store_dir: {store_dir}",
        "run_dir: runs/pile": f"run_dir: {run_dir}",
    }
    for old, new in replacements.items():
        if text.count(old) != 1:
            raise ValueError(f"expected one {old!r} in the config")
        text = text.replace(old, new)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory of the domain files")
    ap.add_argument("--total-mb", type=float, required=True, help="MB (1e6 bytes) of text in all domains")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=0, help="also write The Pile's layout: N files under OUT/train")
    ap.add_argument("--config", type=Path, default=ROOT / "experiments/configs/pile_280m.yaml")
    ap.add_argument("--config-out", type=Path, help="write the pile config with its paths pointing here")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json for --config-out (default OUT/tokenizer.json)")
    args = ap.parse_args(argv)
    if not args.total_mb > 0 or args.shards < 0:
        ap.error(f"expected --total-mb > 0 and --shards >= 0, got {args.total_mb} and {args.shards}")
    try:
        import zstandard  # noqa: F401
    except ImportError:
        ap.error("writing .zst files needs the zstandard package: pip install 'doremi-mix[zst]'")
    out = args.out.resolve()
    tokenizer = (args.tokenizer or out / "tokenizer.json").resolve()
    text = ""
    if args.config_out:
        try:
            text = rewrite_config(args.config.read_text(), out, tokenizer, out / "stores", out / "runs")
        except (ValueError, OSError) as e:
            ap.error(f"{args.config}: {e}")
    counts = write_corpus(args.out, int(args.total_mb * 1e6), args.seed, args.shards)
    for c in counts:
        print(f"{c.name:<20} {c.pile_set_name:<20} {c.documents:>9,} docs {c.text_bytes:>14,} bytes")
    print(f"total {sum(c.documents for c in counts):,} docs, {sum(c.text_bytes for c in counts):,} bytes in {args.out}")
    if args.config_out:
        args.config_out.write_text(text)
        print(f"config: {args.config_out} (put a tokenizer.json at {tokenizer})")


if __name__ == "__main__":
    main()
