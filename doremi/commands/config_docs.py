"""Every config key of an experiment file, documented from the dataclasses themselves.

The dataclasses are the one source: a key's type and default come from the field, its doc from
the comment lines right above it (or the docstring of the section it opens). `doremi config
--keys` prints the table and `python -m doremi.commands.config_docs` writes docs/config.md, which a test
compares with this output, so the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config.tools import to_dict, type_name

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
REGENERATE = "python -m doremi.commands.config_docs"


@dataclass(frozen=True)
class KeyDoc:
    """One key: its path (`data.domains[].paths`), type, default (YAML text) and doc."""

    path: str
    type: str
    default: str
    doc: str


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comment lines right above its declaration in `cls`'s body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    out = {}
    for node in getattr(body, "body", []):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            out[node.target.id] = " ".join(comment)
    return out


def _doc_of(cls: type, name: str) -> str:
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return _field_comments(base).get(name, "")
    return ""


def _class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(cls.__name__ + "("):  # the dataclass-generated signature, no doc
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def _section_type(tp: Any) -> tuple[type | None, bool]:
    """The dataclass a field opens (and whether it is a list of them), or None."""
    if dataclasses.is_dataclass(tp):
        return tp, False  # type: ignore[return-value]
    origin = typing.get_origin(tp)
    if origin is list:
        inner, _ = _section_type(typing.get_args(tp)[0])
        return inner, inner is not None
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            inner, is_list = _section_type(arg)
            if inner is not None:
                return inner, is_list
    return None, False


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return json.dumps(to_dict(value))


def config_keys(cls: type, prefix: str = "") -> list[KeyDoc]:
    """Every key under dataclass `cls`, depth first, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        section, is_list = _section_type(hints[f.name])
        doc = _doc_of(cls, f.name) or (_class_doc(section) if section else "")
        if section is not None and typing.get_origin(hints[f.name]) is None:
            out.append(KeyDoc(path, "section", "", doc))
        else:
            out.append(KeyDoc(path, type_name(hints[f.name]), _default(f), doc))
        if section is not None:
            out.extend(config_keys(section, path + ("[]" if is_list else "")))
    return out


def format_keys(keys: list[KeyDoc]) -> str:
    """Plain text for a terminal: the key, its type and default, the doc indented below."""
    lines = []
    for k in keys:
        default = f" = {k.default}" if k.default else ""
        lines.append(f"{k.path}  ({k.type}){default}")
        if k.doc:
            lines.extend("    " + line for line in textwrap.wrap(k.doc, 92))
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(keys: list[KeyDoc]) -> str:
    """docs/config.md: one table per top-level section."""
    from doremi.config import ExperimentConfig

    out = [
        "# Config keys",
        "",
        f"Generated from the dataclasses by `{REGENERATE}`; do not edit by hand (a test compares).",
        "Print it with `doremi config --keys`, a resolved config with `doremi config CONFIG [--set ...]`,",
        "the model presets with `doremi config --presets`.",
        "",
        "Paths (store_dir, run_dir, data files, tokenizer path, weights files, the reference) are",
        "read against the current directory; a run's saved `config.yaml` records them absolute, so",
        "that `doremi eval RUN` works from any directory. `--set` can index lists:",
        "`--set data.domains[1].paths=[a.jsonl]`.",
        "",
    ]
    hints = typing.get_type_hints(ExperimentConfig)
    for f in dataclasses.fields(ExperimentConfig):
        section, _ = _section_type(hints[f.name])
        out += [f"## `{f.name}`", ""]
        intro = _class_doc(section) if section else ""
        if intro:
            out += [intro, ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for k in keys:
            if k.path.startswith(f.name + ".") or k.path.startswith(f.name + "[]"):
                default = f"`{k.default}`" if k.default else ""
                out.append(f"| `{k.path}` | {_cell(k.type)} | {_cell(default)} | {_cell(k.doc)} |")
        out.append("")
    return "\n".join(out)


def experiment_keys() -> list[KeyDoc]:
    from doremi.config import ExperimentConfig

    return config_keys(ExperimentConfig)


def main(argv: list[str]) -> int:
    """`python -m doremi.commands.config_docs [OUT.md]`: write the page (default docs/config.md)."""
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(
            f"usage: python -m doremi.commands.config_docs [OUT.md] (writes {DOCS_PAGE.name} by default); got {' '.join(argv)}",
            file=sys.stderr,
        )
        return 2
    target = Path(argv[0]) if argv else DOCS_PAGE
    target.write_text(markdown(experiment_keys()))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
