"""Write one synthetic JSON-lines domain of about `--mb` MB (optionally zstd-compressed) and a
config that preprocesses it with the byte tokenizer, to measure the peak RSS of
`doremi preprocess` (issue 42; experiments/notes/PREPROCESS.md):

    .venv/bin/python experiments/tools/preprocess_rss.py --mb 300 --work /tmp/rss300
    /usr/bin/time -v .venv/bin/doremi preprocess /tmp/rss300/config.yaml --force

The documents are 1-8 kB of words drawn from a fixed list with a fixed seed, so the file is the
same on every run; only its size matters for memory.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more out up into do any "
    "mixture domain weight token proxy reference excess loss group robust optimization data ünï ✓ 日本"
).split()

CONFIG = """data:
  store_dir: {work}/stores
  tokenizer: {{kind: byte}}
  validation_fraction: 0.01
  num_proc: 1
  domains:
    - {{name: big, paths: [{path}]}}
"""


def write_corpus(path: Path, mb: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    target = mb * 1_000_000
    written = docs = 0
    compress = path.name.endswith(".zst")
    raw = open(path, "wb")
    if compress:
        import zstandard

        out = zstandard.ZstdCompressor(level=3).stream_writer(raw)
    else:
        out = raw
    with out:
        while written < target:
            n = rng.randint(150, 1200)
            text = " ".join(rng.choices(WORDS, k=n)) + f" {rng.randrange(10**9)}"
            line = (json.dumps({"text": text, "id": docs}, ensure_ascii=False) + "\n").encode()
            out.write(line)
            written += len(line)
            docs += 1
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, required=True, help="uncompressed size of the domain in MB")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--zst", action="store_true", help="write .jsonl.zst (needs zstandard)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / ("big.jsonl.zst" if args.zst else "big.jsonl")
    docs = write_corpus(path, args.mb)
    (args.work / "config.yaml").write_text(CONFIG.format(work=args.work, path=path))
    print(f"{path}: {docs} documents, {path.stat().st_size / 1e6:.1f} MB on disk; config {args.work / 'config.yaml'}")


if __name__ == "__main__":
    main()
