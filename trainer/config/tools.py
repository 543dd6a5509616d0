"""YAML <-> typed dataclasses, with errors that name the key path.

The loader is generic over dataclass types so that each package owns its own section
(`data.config.DataConfig`, `doremi.config.DoReMiConfig`) while the trainer composes them.
Validation happens before any work starts; every error is a `ConfigError` whose message is one
line: the key path, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from data.atomic import atomic_write_text
from data.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration problem, reported as one line naming the key path."""


#: The tag of a strict number: `Annotated[float, NUMBER]` takes an int or a float and refuses a
#: bool or a string (plain `float` fields take "3e-4"; a weight typed `true` must not become 1).
NUMBER = "number"

#: The tag of a file-system path: `Annotated[str, PATH]`. A relative one is read against the
#: current directory, as every path the user types is; `dump_yaml` writes it absolute, so that a
#: run's saved config.yaml means the same from any directory (`doremi eval RUN` from elsewhere).
PATH = "path"
#: The tag of a value that is a path when one exists there, and a name otherwise (a weights JSON
#: or `uniform`; a local tokenizer or a hub name): written absolute only when it exists.
PATH_OR_NAME = "path or name"


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML with YAML 1.2's floats: `1e-3` (no dot) is a float, not the string PyYAML's 1.1
    rules make it, so that a number typed as a number is one wherever it appears. Parsed by
    libyaml where PyYAML has it (the same values, 8x less CPU: a run's config took 35 ms in pure
    Python, and a pipeline reads dozens; experiments/notes/SUITE.md)."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose keys are each written once: PyYAML keeps the last of two `train:`
    sections (or two `lr:` keys) silently, so the first one's keys would be dropped without a
    word; a duplicate is refused as invalid YAML, naming its line."""
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # an unhashable key: the constructor below names it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found key {key!r} twice", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=Loader)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def type_name(tp: Any) -> str:
    """A type as the messages and the key docs name it (`list of str`, `one of 'a', 'b'`)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *tags = typing.get_args(tp)
        return "number" if NUMBER in tags else type_name(base)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        args = typing.get_args(tp)
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _finite(value: float, path: str) -> float:
    """Every float key goes through here: NaN or infinity in a config is a typo or a
    placeholder, never a setting (`grad_clip: nan` silently meant no clipping), so it is refused
    once for all keys, naming the key."""
    if not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value}")
    return value


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert `value` to type `tp` or raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Annotated:
        return _coerce_annotated(value, tp, path)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, path)
    if origin is typing.Literal:
        return _coerce_literal(value, tp, path)
    if dataclasses.is_dataclass(tp):
        return _coerce_dataclass(value, tp, path)
    if origin in (list, tuple):
        return _coerce_sequence(value, tp, path)
    if origin is dict:
        return _coerce_mapping(value, tp, path)
    if tp is bool:
        return _coerce_bool(value, path)
    if tp is int:
        return _coerce_int(value, path)
    if tp is float:
        return _coerce_float(value, path)
    if tp is str:
        return _coerce_str(value, path)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {_describe(value)}")
    return value


def _coerce_annotated(value: Any, tp: Any, path: str) -> Any:
    """`Annotated[base, tags]`: a NUMBER tag refuses bools and strings before the base type
    would accept them."""
    base, *tags = typing.get_args(tp)
    if NUMBER in tags and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{path}: expected a number (int or float), got {_describe(value)}")
    return _coerce(value, base, path)


def _coerce_union(value: Any, tp: Any, path: str) -> Any:
    """A union: the one member that fits the value's shape, else the first member that takes
    it, so that an error names the item at fault rather than the whole union."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    # A list or a mapping can only be the union's one list or mapping member: its own
    # error names the item at fault (`x[2]: expected a number`), not the whole union.
    kind = list if isinstance(value, (list, tuple)) else dict if isinstance(value, dict) else None
    same = [a for a in args if kind and typing.get_origin(a) in ((list, tuple) if kind is list else (dict,))]
    if len(same) == 1:
        return _coerce(value, same[0], path)
    # Likewise a mapping for the union's one dataclass (`model.moe: MoEConfig | None`).
    classes = [a for a in args if dataclasses.is_dataclass(a)]
    if kind is dict and not same and len(classes) == 1:
        return _coerce(value, classes[0], path)
    # Try exact-type members first so that "1" stays a str in `int | str`.
    ordered = sorted(args, key=lambda a: 0 if isinstance(a, type) and type(value) is a else 1)
    for arg in ordered:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {type_name(tp)}, got {_describe(value)}")


def _coerce_literal(value: Any, tp: Any, path: str) -> Any:
    choices = typing.get_args(tp)
    if value in choices:
        return value
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    extra = f" (did you mean {hint[0]!r}?)" if hint else ""
    raise ConfigError(f"{path}: expected {type_name(tp)}, got {_describe(value)}{extra}")


def _coerce_dataclass(value: Any, tp: Any, path: str) -> Any:
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
    return from_dict(tp, value, path)


def _coerce_sequence(value: Any, tp: Any, path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {_describe(value)}")
    (arg,) = typing.get_args(tp)[:1] or (Any,)
    items = [_coerce(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    return items if typing.get_origin(tp) is list else tuple(items)


def _coerce_mapping(value: Any, tp: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {_describe(value)}")
    kt, vt = typing.get_args(tp) or (Any, Any)
    return {_coerce(k, kt, path): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()}


def _coerce_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{path}: expected bool, got {_describe(value)}")


def _coerce_int(value: Any, path: str) -> int:
    """An int, or a float with no fractional part (`1e3` in YAML 1.2 is a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected int, got {_describe(value)}")
    return value


def _coerce_float(value: Any, path: str) -> float:
    if isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected float, got {_describe(value)}")
    return _finite(float(value), path)


def _coerce_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected str, got {_describe(value)}")
    return value


def moved_line(old: str, new: str, value: Any) -> str:
    """`doremi.eta: moved to mixing.doremi.eta`: a section `cls.MOVED` says has moved (its first
    key named, so that the line points at what to rewrite)."""
    first = next(iter(value), None) if isinstance(value, dict) else None
    return f"{old}.{first}: moved to {new}.{first}" if first is not None else f"{old}: moved to {new}"


def from_dict(cls: type[T], raw: dict[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with a suggestion, and a
    section the class has moved (its class attribute `MOVED`: old key -> new path) with a line
    naming the new key."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    moved = getattr(cls, "MOVED", {})
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if key in moved:
            raise ConfigError(moved_line(where, moved[key], value))
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {(path + '.' if path else '') + close[0]}?)" if close else ""
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {where}{hint}; valid keys here: {valid}")
        kwargs[key] = _coerce(value, hints[key], where)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        name = (path + "." if path else "") + (missing[0] if missing else "?")
        raise ConfigError(f"{name}: required key is missing") from e
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(path)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclasses to plain YAML-able structures."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


_KEY_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)((?:\[-?[0-9]+\])*)")


def _split_key(text: str, key: str) -> list[str | int]:
    """`data.domains[1].paths` -> ["data", "domains", 1, "paths"]."""
    parts: list[str | int] = []
    for part in key.split("."):
        m = _KEY_PART.fullmatch(part)
        if m is None:
            raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE (a key may index a list: a.b[0].c)")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"-?[0-9]+", m.group(2)))
    return parts


def _key_text(keys: list[str | int]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else (f".{k}" if i else k) for i, k in enumerate(keys))


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`a.b[0].c=value` -> (["a", "b", 0, "c"], value parsed as YAML, so 3 is an int and [1,2] a list)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    keys = _split_key(text, key)
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides to the raw mapping; the typed load coerces and validates them.

    A missing section is created; a list is indexed by an existing position only (`[1]` of a
    two-domain list), since a new entry would lack its required keys."""
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = raw
        for i, k in enumerate(keys):
            last = i == len(keys) - 1
            here = _key_text(keys[: i + 1])
            if isinstance(k, int):
                if not isinstance(node, list):
                    raise ConfigError(f"--set {text}: {_key_text(keys[:i])} is not a list")
                if not -len(node) <= k < len(node):
                    raise ConfigError(
                        f"--set {text}: {here}: index out of range ({_key_text(keys[:i])} has {len(node)} entries)"
                    )
            elif not isinstance(node, dict):
                raise ConfigError(f"--set {text}: {_key_text(keys[:i])} is not a section")
            if last:
                node[k] = value
                break
            child = node[k] if isinstance(k, int) else node.get(k)
            if child is None:
                if isinstance(keys[i + 1], int):
                    raise ConfigError(f"--set {text}: {here} is not a list")
                child = node[k] = {}
            if isinstance(keys[i + 1], int) and not isinstance(child, list):
                raise ConfigError(f"--set {text}: {here} is not a list")
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {text}: {here} is not a section")
            node = child
    return raw


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        raw = load_yaml(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return raw


def _absolute(value: Any, tp: Any) -> Any:
    """`value` of type `tp` with its PATH-tagged strings made absolute (see `PATH`)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *tags = typing.get_args(tp)
        if isinstance(value, str) and value and (PATH in tags or (PATH_OR_NAME in tags and Path(value).exists())):
            return os.path.abspath(os.path.expanduser(value))
        return _absolute(value, base)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is typing.Annotated or typing.get_origin(arg) in (list, tuple, dict):
                value = _absolute(value, arg)
            elif dataclasses.is_dataclass(arg) and isinstance(value, arg):
                value = absolute_paths(value)
        return value
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        (arg,) = typing.get_args(tp)[:1] or (Any,)
        return type(value)(_absolute(v, arg) for v in value)
    if origin is dict and isinstance(value, dict):
        _, vt = typing.get_args(tp) or (Any, Any)
        return {k: _absolute(v, vt) for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(value):
        return absolute_paths(value)
    return value


def absolute_paths(obj: T) -> T:
    """A copy of dataclass `obj` whose path-tagged fields (`PATH`, `PATH_OR_NAME`) are absolute."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    fields = [f for f in dataclasses.fields(obj) if f.init]  # type: ignore[arg-type]
    changes = {f.name: _absolute(getattr(obj, f.name), hints[f.name]) for f in fields}
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def dump_yaml(obj: Any, path: str | os.PathLike) -> None:
    """Write a config as YAML, its paths absolute (`PATH`) when it is a dataclass."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = absolute_paths(obj)
    atomic_write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))
