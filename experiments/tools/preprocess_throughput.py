"""Preprocessing throughput (tokens/s) on the embedded quickstart corpus and on a generated jsonl.

The generated corpus (default 200 MB, one domain) is made of paragraphs of the embedded corpus
shuffled into new documents of 1-8 kB, with random identifiers and numbers mixed in so that it
is not a copy of the BPE's training text. Each measurement is a full `preprocess(force=True)`:
read through `datasets`, split, (train the BPE,) tokenize in `num_proc` processes, write.

    python experiments/tools/preprocess_throughput.py [--mb 200] [--work /tmp/doremi_throughput]
        [--tokenizers byte bpe] [--num-proc 1 2] [--repeats-big 1] [--json results.json]

Rows: `byte`; `bpe-N` (training the BPE on at most 20 M characters of the corpus, then
encoding); `file:trained_bpe.json` (that trained BPE loaded from file: encoding only). Times are
the best of `--repeats-small` (3) rebuilds for the quickstart corpus and of `--repeats-big` (1)
for the generated corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import time
from pathlib import Path

from data.config import DataConfig, DomainSource, TokenizerConfig
from data.preprocess.preprocess import preprocess
from data.sources.sources import read_embedded


def generate_jsonl(path: Path, megabytes: int, seed: int = 0) -> int:
    """Write about `megabytes` MB of {"text"} documents; return the number of documents."""
    rng = random.Random(seed)
    paragraphs = [
        p
        for name in ("code", "docs", "notes")
        for doc in read_embedded(name)
        for p in re.split(r"\n\s*\n", doc)
        if p.strip()
    ]
    target, written, docs = megabytes * 1_000_000, 0, 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            size, parts = rng.randint(1_000, 8_000), []
            while sum(map(len, parts)) < size:
                p = rng.choice(paragraphs)
                if rng.random() < 0.3:
                    p = p.replace("self", f"obj{rng.randint(0, 99_999)}").replace("0", str(rng.randint(0, 9)))
                parts.append(p)
            line = json.dumps({"text": "\n\n".join(parts) + "\n", "id": docs}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    os.replace(tmp, path)
    return docs


def measure(name: str, cfg: DataConfig, repeats: int) -> dict:
    """Best wall time of `repeats` full rebuilds (the minimum: on a shared machine, other load
    only ever adds time)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        manifest = preprocess(cfg, force=True, progress=False)
        times.append(time.perf_counter() - start)
    seconds = min(times)
    tokens = sum(d.train.tokens + d.validation.tokens for d in manifest.domains)
    docs = sum(d.train.documents + d.validation.documents for d in manifest.domains)
    row = {
        "corpus": name,
        "tokenizer": manifest.tokenizer["name"],
        "num_proc": cfg.num_proc,
        "documents": docs,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--work", default="/tmp/doremi_throughput")
    ap.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"])
    ap.add_argument("--num-proc", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--bpe-vocab", type=int, default=2048)
    ap.add_argument("--repeats-small", type=int, default=3)
    ap.add_argument("--repeats-big", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    big = work / f"generated_{args.mb}mb.jsonl"
    if not big.is_file():
        t = time.perf_counter()
        n = generate_jsonl(big, args.mb)
        print(
            f"generated {big} ({big.stat().st_size / 1e6:.0f} MB, {n} documents) in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
    generated = [DomainSource(name="generated", paths=[str(big)])]
    corpora = {
        "quickstart (embedded, 1.66 MB)": [DomainSource(name=n, embedded=n) for n in ("code", "docs", "notes")],
        f"generated jsonl ({big.stat().st_size / 1e6:.0f} MB)": generated,
    }
    # Warm-up: imports and first-use costs are not throughput.
    preprocess(
        DataConfig(domains=corpora[next(iter(corpora))][:1], num_proc=1, store_dir=str(work / "warmup")),
        force=True,
        progress=False,
    )
    rows = []
    trained = work / "trained_bpe.json"
    for repeats, (corpus, domains) in zip((args.repeats_small, args.repeats_big), corpora.items()):
        kinds = list(args.tokenizers) + (["file"] if "bpe" in args.tokenizers else [])
        for kind in kinds:
            for num_proc in args.num_proc:
                # `file`: the BPE just trained on this corpus, loaded from its tokenizer.json, so
                # the row measures reading + encoding + writing without the BPE training.
                tok = TokenizerConfig(
                    kind=kind,
                    vocab_size=args.bpe_vocab,
                    train_max_bytes=20_000_000,
                    path=str(trained) if kind == "file" else None,
                )
                cfg = DataConfig(domains=domains, num_proc=num_proc, store_dir=str(work / "stores"), tokenizer=tok)
                rows.append(measure(corpus, cfg, repeats))
                if kind == "bpe":
                    shutil.copyfile(work / "stores" / "tokenizer.json", trained)
    info = {
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2) + "\n")
    print("\n| corpus | tokenizer | num_proc | documents | tokens | seconds | tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['corpus']} | {r['tokenizer']} | {r['num_proc']} | {r['documents']:,} | {r['tokens']:,} | "
            f"{r['seconds']} | {r['tokens_per_s']:,} |"
        )


if __name__ == "__main__":
    main()
