"""Atomic file writes: a temp file in the target's directory, fsync, then rename.

A reader (or a crash) never sees a half-written file: either the old content or the new.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it over `path`, on error remove it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a failed write or fsync (no space left) names no file: name it
            raise type(e)(e.errno, e.strerror or str(e), str(p)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask_mode(mode: int = 0o777) -> int:
    """`mode` under the process's umask: what `mkdir` or `open` would give."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def staging_dir(parent: str | os.PathLike, prefix: str, suffix: str = ".tmp") -> Path:
    """A new private directory in `parent` to build a result in before renaming it into place,
    with the mode `mkdir` would give (mkdtemp makes 0700: an export renamed from it would be
    unreadable to the rest of a group on a shared file system)."""
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=suffix))
    os.chmod(path, umask_mode())
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` via a temp file in the same directory and a rename."""
    atomic_write_bytes(path, text.encode())
