"""Tests of experiments/tools/real_corpus.py against fixture packages built here (no network).

A fake .deb (built with `dpkg-deb --build`, holding a nested .tar.xz like linux-source) and a
fake npm .tgz are put in the download cache, so no package client is called; the recipe is
passed in through `main(argv, recipe=...)`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import zlib
from pathlib import Path

import pytest

from tests.scripts import load_script

BUILD_PY = Path(__file__).resolve().parents[1] / "experiments" / "tools" / "real_corpus.py"

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")


rc = load_script(BUILD_PY, "real_corpus_build")

CODE = {
    "usr/share/fake/src/a.c": "int a(void) { return 1; }\n",
    "usr/share/fake/src/b.c": "int b(void) { return 2; }\n",
    "usr/share/fake/src/sub/dup.c": "int a(void) { return 1; }\n",  # duplicate of a.c
    "usr/share/fake/src/empty.c": "  \n",
    "usr/share/fake/src/skip/gen.c": "int skipped_by_exclude;\n",
}
MAIL = {
    f"package/data/m{i:02d}.txt": f"From: user{i}@example.org\nSubject: {i}\n\n" + "word " * (10 + i) for i in range(30)
}


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _make_deb(tmp: Path) -> Path:
    root = tmp / "debroot"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: fakepkg\nVersion: 1.2-3\nArchitecture: all\nMaintainer: T <t@example.org>\nDescription: fixture\n"
    )
    files: dict[str, bytes] = {k: v.encode() for k, v in CODE.items()}
    files["usr/share/fake/src/big.c"] = b"x" * (rc.MAX_DOC_BYTES + 1)
    files["usr/share/fake/src/blob.c"] = b"\x7fELF\x00\x01"
    files["usr/share/fake/src/latin1.c"] = "caf\xe9".encode("latin-1")
    files["usr/share/fake/README.txt"] = b"not code\n"
    files["usr/share/doc/fakepkg/copyright"] = b"Format: x\n\nFiles: *\nLicense: MIT\n"
    files["usr/src/inner.tar.xz"] = _tar_xz(
        {
            "inner/arch/board.dts": b'/dts-v1/;\n/ { model = "fake"; };\n',
            "inner/arch/soc.dtsi": b"/ { cpus { }; };\n",
            "inner/kernel/x.c": b"int x;\n",
        }
    )
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    deb = tmp / "fakepkg_1.2-3_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    return deb


def _make_tgz(tmp: Path) -> Path:
    files = {
        "package/package.json": json.dumps(
            {"name": "@scope/fake-mail", "version": "0.9.1", "license": "Apache-2.0"}
        ).encode()
    }
    files.update({k: v.encode() for k, v in MAIL.items()})
    path = tmp / "scope-fake-mail-0.9.1.tgz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pkgs")
    return {"deb:fakepkg": _make_deb(tmp), "npm:@scope/fake-mail": _make_tgz(tmp)}


@pytest.fixture()
def cache(tmp_path, packages) -> Path:
    """A download cache holding the fixture packages: fetch() finds them and calls no client."""
    cache = tmp_path / "cache"
    for name, path in packages.items():
        d = rc.cache_dir_for(name, cache)
        d.mkdir(parents=True)
        shutil.copy(path, d / path.name)
    return cache


RECIPE = {
    "code": [rc.Rule("deb:fakepkg", r"^usr/share/fake/src/.*\.c$", rc.plain, exclude=r"/skip/")],
    "dts": [rc.Rule("deb:fakepkg", r"^inner/arch/.*\.dtsi?$", rc.plain, "usr/src/inner.tar.xz")],
    "mail": [rc.Rule("npm:@scope/fake-mail", r"^package/data/.*\.txt$")],
}


def _run(out: Path, cache: Path, *extra: str, recipe=RECIPE) -> int:
    return rc.main(["--out", str(out), "--cache", str(cache), *extra], recipe=recipe)


def _docs(path: Path) -> list[dict]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_documents_follow_the_filters_and_duplicates_are_dropped(tmp_path, cache):
    out = tmp_path / "out"
    assert _run(out, cache) == 0
    code = {d["source"]: d["text"] for d in _docs(out / "code.jsonl.xz")}
    assert code == {
        "fakepkg:usr/share/fake/src/a.c": CODE["usr/share/fake/src/a.c"],
        "fakepkg:usr/share/fake/src/b.c": CODE["usr/share/fake/src/b.c"],
    }
    dts = sorted(d["source"] for d in _docs(out / "dts.jsonl.xz"))
    assert dts == ["fakepkg:inner/arch/board.dts", "fakepkg:inner/arch/soc.dtsi"]
    assert len(_docs(out / "mail.jsonl.xz")) == len(MAIL)
    m = json.loads((out / "manifest.json").read_text())
    assert m["outputs"]["code"]["duplicates_dropped"] == 1
    assert m["outputs"]["code"]["uncapped_documents"] == 2


def test_manifest_records_packages_and_outputs(tmp_path, cache, packages):
    out = tmp_path / "out"
    assert _run(out, cache) == 0
    m = json.loads((out / "manifest.json").read_text())
    deb, npm = m["packages"]["deb:fakepkg"], m["packages"]["npm:@scope/fake-mail"]
    assert deb["version"] == "1.2-3" and deb["sha256"] == _sha(packages["deb:fakepkg"])
    assert deb["licence"] == "MIT"
    assert npm["version"] == "0.9.1" and npm["sha256"] == _sha(packages["npm:@scope/fake-mail"])
    assert npm["licence"] == "Apache-2.0"
    for entry in m["outputs"].values():
        path = out / entry["file"]
        docs = _docs(path)
        assert entry["sha256"] == _sha(path)
        assert entry["documents"] == len(docs)
        assert entry["text_bytes"] == sum(len(d["text"].encode()) for d in docs)
        assert entry["xz_bytes"] == path.stat().st_size
        assert entry["uncapped_bytes"] >= entry["text_bytes"]
        assert entry["licence"]
    assert m["outputs"]["mail"]["uncapped_bytes"] == sum(len(v.encode()) for v in MAIL.values())


def test_byte_cap_takes_a_seeded_prefix(tmp_path, cache):
    cap = 600
    outs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        outs[name] = tmp_path / name
        assert _run(outs[name], cache, "--max-bytes", str(cap), "--seed", str(seed), "--domains", "mail") == 0
    a, b, c = (outs[k] / "mail.jsonl.xz" for k in "abc")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    for out, seed in [(outs["a"], 0), (outs["c"], 1)]:
        texts = [d["text"] for d in _docs(out / "mail.jsonl.xz")]
        assert sum(len(t.encode()) for t in texts) <= cap
        # The kept documents are the longest prefix of the seeded order that fits.
        col = rc.Collector(cap, seed)
        order = sorted(MAIL.values(), key=lambda t: col.key(hashlib.sha256(t.encode()).digest()))
        prefix, total = [], 0
        for t in order:
            if total + len(t.encode()) > cap:
                break
            prefix.append(t)
            total += len(t.encode())
        assert texts == prefix and 0 < len(texts) < len(MAIL)


def test_per_domain_cap_overrides_max_bytes(tmp_path, cache, capsys):
    big, small = tmp_path / "big", tmp_path / "small"
    assert _run(big, cache, "--max-bytes", "600", "--cap", "mail=100000", "--domains", "mail") == 0
    assert _run(small, cache, "--max-bytes", "600", "--domains", "mail") == 0
    got = json.loads((big / "manifest.json").read_text())
    assert got["options"]["caps"] == {"mail": 100000}
    assert got["outputs"]["mail"]["text_bytes"] == sum(len(v.encode()) for v in MAIL.values())
    assert json.loads((small / "manifest.json").read_text())["outputs"]["mail"]["text_bytes"] <= 600
    capsys.readouterr()
    assert _run(tmp_path / "bad", cache, "--cap", "nosuch=5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cap nosuch=5" in err[0]
    assert not (tmp_path / "bad").exists()


def test_second_run_does_no_work(tmp_path, cache, capsys):
    out = tmp_path / "out"
    assert _run(out, cache) == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert _run(out, cache) == 0
    assert "up to date" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # A changed option is a different build.
    assert _run(out, cache, "--seed", "5") == 0
    assert "up to date" not in capsys.readouterr().err


def _fake_client(tmp_path: Path, monkeypatch) -> None:
    """apt-get and npm that fail like the real ones do for an unknown package."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("apt-get", "npm"):
        p = bin_dir / tool
        p.write_text('#!/bin/sh\necho "E: Unable to locate package $2" >&2\nexit 100\n')
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_missing_package_exits_2_and_writes_nothing(tmp_path, cache, capsys, monkeypatch):
    _fake_client(tmp_path, monkeypatch)
    recipe = dict(RECIPE, gone=[rc.Rule("deb:no-such-package", r"\.txt$")])
    out = tmp_path / "out"
    assert _run(out, cache, recipe=recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert errors == err[-1:]
    assert len(errors) == 1 and "no-such-package" in errors[0]
    assert not out.exists() or not any(out.iterdir())
    assert not rc.cache_dir_for("deb:no-such-package", cache).exists()


def test_changed_layout_exits_2_and_keeps_the_previous_build(tmp_path, cache, capsys):
    out = tmp_path / "out"
    assert _run(out, cache) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    recipe = dict(RECIPE, code=[rc.Rule("deb:fakepkg", r"^usr/share/moved/.*\.c$")])
    capsys.readouterr()
    assert _run(out, cache, recipe=recipe) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert "deb:fakepkg" in errors[0] and "usr/share/moved" in errors[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_missing_nested_archive_is_a_changed_layout(tmp_path, cache, capsys):
    recipe = {"dts": [rc.Rule("deb:fakepkg", r"\.dts$", rc.plain, "usr/src/other.tar.xz")]}
    assert _run(tmp_path / "out", cache, recipe=recipe) == 2
    assert "usr/src/other.tar.xz" in capsys.readouterr().err


def test_extractors():
    brown = b"\n\n\tThe/at jury/nn said/vbd ./.\n\n\tIt/pps ended/vbd ./.\n"
    assert list(rc.brown_untagged("ca01", brown)) == [("ca01", "The jury said .\n\nIt ended .")]
    wn = (
        b"  1 This software and database is being provided\n"
        b"00001740 03 n 02 entity 0 thing 1 000 | that which is perceived to exist\n"
    )
    assert list(rc.wordnet_glosses("data.noun", wn)) == [
        ("data.noun#0", "entity, thing: that which is perceived to exist")
    ]
    dz = gzip.compress(
        b"00-database-url\n   x\n\nWord \\Word\\, n.\n   A unit.\n\n   Syn: term\n\n"
        b"Bad \\Bad\\ \x92\n\nZeal \\Zeal\\, n.\n   Ardor.\n"
    )
    ((name, text),) = rc.dictd_entries("gcide.dict.dz", dz)
    assert text == "Word \\Word\\, n.\n   A unit.\n\n   Syn: term\n\nZeal \\Zeal\\, n.\n   Ardor."
    page = (
        b"<html><head><title>T</title><style>x{}</style></head><body>"
        b"<ul class='docnav'><li>Prev</li></ul><h1>Title</h1><p>One  two\nthree.</p>"
        b"<pre>a\n  b</pre><script>bad()</script></body></html>"
    )
    assert list(rc.html_text("p.html", page)) == [("p.html", "Title\n\nOne two three.\n\na\n  b")]
    osis = [
        b'<title type="main">Genesis</title><chapter sID="Gen.1"/>In the <w lemma="s">beginning</w>'
        b"<note>a note</note> God.",
        b'<chapter sID="Exo.1"/>Now these.',
    ]
    bzz = b"".join(zlib.compress(block) + b"\x00" * 7 for block in osis)
    assert [t for _, t in rc.sword_ztext("ot.bzz", bzz)] == ["Genesis\n\nIn the beginning God.", "Now these."]
    hexdump = "static const u8 fw[] = {\n" + "0x01, 0x02, 0x03, 0x04,\n" * 400 + "};\n"
    assert list(rc.c_source("fw.h", hexdump.encode())) == []
