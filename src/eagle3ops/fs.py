"""Writes that never leave half a result behind: a crash leaves the previous output or nothing."""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3ops.errors import InputError

NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class NotWritableError(InputError):
    """An output that cannot be written where it was asked for."""


@contextmanager
def _writable(path: Path) -> Iterator[None]:
    """Creating the temporary sibling of `path`: a read-only or forbidden place is one clear line."""
    try:
        yield
    except OSError as err:
        if err.errno not in NOT_WRITABLE:
            raise
        raise NotWritableError(f"{path}: cannot write there ({err.strerror}: {err.filename or path.parent})") from None


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _atomic_write(path: Path, write) -> None:
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            write(out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    count = 0

    def write(out):
        nonlocal count
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1

    _atomic_write(Path(path), write)
    return count


def write_json_atomic(path: str | Path, obj) -> None:
    _atomic_write(Path(path), lambda out: out.write(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def write_text_atomic(path: str | Path, text: str) -> None:
    _atomic_write(Path(path), lambda out: out.write(text))


def link_or_copy(source: str | Path, destination: str | Path) -> None:
    """A hard link where the disk allows (a 2 GB drafter need not be stored twice), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
