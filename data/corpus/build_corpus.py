"""Build the embedded quickstart corpus from the running Python's own files.

Three real domains that differ in form, all from the CPython distribution (PSF License 2.0):

- `code`:  standard-library Python source modules, one document per file.
- `docs`:  the language reference topics shipped as `pydoc_data.topics` (reStructuredText prose
           with grammar snippets), one document per section.
- `notes`: IDLE's plain-text change logs and notes (`idlelib/NEWS*.txt`, `HISTORY.txt`, ...),
           paragraphs grouped into documents of at least 800 characters
           within a release section.

Each domain is written as `<domain>.jsonl.gz` (one `{"text", "source"}` object per line, gzip
with a zero timestamp so that the bytes are reproducible), and `corpus.json` records the Python
version, document/character counts and SHA-256 of each file. Run:

    python data/corpus/build_corpus.py [--out data/corpus] [--code-chars 1000000]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import platform
import re
import sys
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "lib2to3",
    "site-packages",
    "turtledemo",
    "distutils",
    "ensurepip",
    "encodings",
    "pydoc_data",
    "__pycache__",
    "__phello__",
}
HEADING = re.compile(r"\n(?=[^\n]+\n(?:\*{3,}|={3,}|-{3,}|~{3,})\n)")
NOTES_FILES = ["NEWS.txt", "NEWS2x.txt", "HISTORY.txt", "README.txt", "TODO.txt", "extend.txt", "CREDITS.txt"]
RELEASE_HEADER = re.compile(r"\n(?=What's New in IDLE )")


def code_documents(lib: Path, max_chars: int) -> list[dict]:
    """Modules of 1-25 kB under Lib/ (no tests, GUIs or vendored code), a deterministic spread
    (every k-th by path) up to `max_chars` characters."""
    files = sorted(
        p
        for p in lib.rglob("*.py")
        if not EXCLUDED_DIRS & set(p.relative_to(lib).parts[:-1])
        and not p.name.startswith("_sysconfigdata")
        and 1_000 <= p.stat().st_size <= 25_000
    )
    total = sum(p.stat().st_size for p in files)
    stride = max(1, round(total / max_chars))
    docs = []
    for p in files[::stride]:
        docs.append({"text": p.read_text(encoding="utf-8"), "source": f"Lib/{p.relative_to(lib)}"})
    return docs


def docs_documents() -> list[dict]:
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        for i, section in enumerate(s.strip("\n") for s in HEADING.split(topics[name])):
            if section.strip():
                docs.append({"text": section + "\n", "source": f"pydoc_data.topics[{name!r}]#{i}"})
    return docs


def notes_documents(lib: Path, min_chars: int = 800) -> list[dict]:
    docs = []
    for name in NOTES_FILES:
        path = lib / "idlelib" / name
        if not path.is_file():
            continue
        for i, section in enumerate(RELEASE_HEADER.split(path.read_text(encoding="utf-8"))):
            for j, chunk in enumerate(_paragraph_chunks(section, min_chars)):
                docs.append({"text": chunk, "source": f"Lib/idlelib/{name}#{i}.{j}"})
    return docs


def _paragraph_chunks(text: str, min_chars: int) -> list[str]:
    """Consecutive paragraphs merged until each chunk holds at least `min_chars` characters."""
    chunks, current = [], []
    for para in (p.strip("\n") for p in re.split(r"\n\s*\n", text)):
        if not para.strip():
            continue
        current.append(para)
        if sum(len(c) for c in current) >= min_chars:
            chunks.append("\n\n".join(current) + "\n")
            current = []
    if current:
        chunks.append("\n\n".join(current) + "\n")
    return chunks


def write_jsonl_gz(path: Path, docs: list[dict]) -> str:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        for d in docs:
            gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(raw.getvalue())
    return hashlib.sha256(raw.getvalue()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--code-chars", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    domains = {"code": code_documents(lib, args.code_chars), "docs": docs_documents(), "notes": notes_documents(lib)}
    meta = {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "license": "PSF-2.0",
        "domains": {},
    }
    for name, docs in domains.items():
        sha = write_jsonl_gz(out / f"{name}.jsonl.gz", docs)
        meta["domains"][name] = {
            "file": f"{name}.jsonl.gz",
            "documents": len(docs),
            "characters": sum(len(d["text"]) for d in docs),
            "sha256": sha,
        }
        print(f"{name}: {len(docs)} documents, {meta['domains'][name]['characters']} characters")
    (out / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
