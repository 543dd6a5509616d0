"""doremi/reports/outputs.py: a report command replaces only the files it wrote (its mark in the
file's own format), and refuses any other file of those names before writing (design 6b)."""

from __future__ import annotations

import json

import pytest

from data.artifact import ArtifactError
from doremi.reports.outputs import WRITTEN_BY, check_outputs, is_ours, md_mark, png_metadata


def _png(path, metadata=None) -> None:
    from matplotlib.figure import Figure

    from doremi.reports.report import _save

    fig = Figure(figsize=(1, 1))
    fig.subplots().plot([0, 1])
    _save(fig, path, metadata)


def test_each_format_carries_its_mark(tmp_path):
    md, js, png = tmp_path / "a.md", tmp_path / "a.json", tmp_path / "a.png"
    md.write_text(md_mark("doremi study summarize") + "# The study\n")
    js.write_text(json.dumps({WRITTEN_BY: "doremi study summarize", "x": 1}))
    _png(png, png_metadata("doremi study summarize"))
    assert is_ours(md) and is_ours(js) and is_ours(png)
    (tmp_path / "m.yaml").write_text("# doremi import /hf/llama: merge into an experiment file\nmodel: {}\n")
    (tmp_path / "e.yaml").write_text("model: {}\n# doremi import\n")
    assert is_ours(tmp_path / "m.yaml") and not is_ours(tmp_path / "e.yaml")
    md.write_text("# The study\n<!-- written by doremi study summarize -->\n")  # not the first line
    js.write_text(json.dumps({"x": 1, "note": "written_by doremi"}))
    _png(png)  # matplotlib's own Software text
    assert not (is_ours(md) or is_ours(js) or is_ours(png))
    (tmp_path / "b.json").write_text("{cut short")
    (tmp_path / "c.txt").write_text("doremi")
    assert not is_ours(tmp_path / "b.json") and not is_ours(tmp_path / "c.txt") and not is_ours(tmp_path)


def test_check_outputs_refuses_a_foreign_file_or_a_file_as_out(tmp_path):
    check_outputs(tmp_path / "new", ("study.md",), "doremi study summarize")  # absent: fine
    (tmp_path / "study.md").write_text(md_mark("doremi study summarize"))
    check_outputs(tmp_path, ("study.md", "study.json"), "doremi study summarize")
    (tmp_path / "study.json").write_text("{}")
    with pytest.raises(
        ArtifactError, match=r"study.json: exists and was not written by doremi; `doremi study summarize`"
    ):
        check_outputs(tmp_path, ("study.md", "study.json"), "doremi study summarize")
    (tmp_path / "f").write_text("")
    with pytest.raises(ArtifactError, match=r"f: not a directory; `doremi compare --out` takes a folder"):
        check_outputs(tmp_path / "f", ("compare.md",), "doremi compare")
    (tmp_path / "d" / "compare.md").mkdir(parents=True)
    with pytest.raises(ArtifactError, match="compare.md: exists and was not written by doremi"):
        check_outputs(tmp_path / "d", ("compare.md",), "doremi compare")
