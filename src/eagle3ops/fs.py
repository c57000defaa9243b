"""Writes that never leave half a result behind, never replace what is not theirs, and say when the disk is full.

A crash leaves the previous output or nothing (atomic_dir, atomic_path and the write_*_atomic functions). An output
at a path the user names on the command line (OUTPUTS: export OUT, compare --out, check-compat --json, ...)
replaces only a previous output of its own kind, recognised by the marker or the layout its writer leaves; anything
else there is refused in one line naming what is there, and nothing is written. The outputs a DVC stage writes at
its own paths (dvc.yaml outs: DVC owns them) are replaced whatever they hold. A write that finds the disk full is one
line naming the path and the space left (DiskFullError); probe_writable checks a stage's output places before it
starts working.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3ops.errors import InputError

# The project's own working files, beside its checkout and never in the lineage: resume points, compile cache, logs,
# one-off metrics, the outbox, engine work folders (each module names its folder in it)
WORK_DIR = Path(".eagle3ops")
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
# How a full disk reads: Python's OSError, torch.save's writer ("unexpected pos N vs M" when a write came up
# short, "file write failed"), safetensors' ("I/O error: No space left on device (os error 28)").
DISK_FULL_TEXTS = ("No space left on device", "(os error 28)", "unexpected pos", "file write failed")
KEPT = "what was there before is kept: free space and run again"


class NotWritableError(InputError):
    """An output that cannot be written where it was asked for."""


class DiskFullError(InputError):
    """No space left for an output; what was there before it is kept."""


class NotOursError(InputError):
    """An output path that holds something other than a previous output of the same kind."""


# ---------------------------------------------------------------------------------------- what a path may replace

@dataclass(frozen=True)
class Output:
    """What a command writes at a path its user names, and how a previous one is recognised: a directory by the
    `marker` file its writer leaves in it, or by holding nothing but the `only` files it writes; a file by its
    content (`looks`)."""

    what: str  # in the refusal: "{path} exists and is not {what}"
    option: str  # the argument that names the path: "choose another {option}"
    marker: str = ""
    only: frozenset[str] = frozenset()
    looks: Callable[[Path], bool] | None = None

    @property
    def directory(self) -> bool:
        return self.looks is None

    def recognises(self, path: Path) -> bool:
        if path.is_symlink():
            return False
        if self.directory:
            return path.is_dir() and bool((self.marker and (path / self.marker).is_file())
                                          or (self.only and {p.name for p in path.iterdir()} <= self.only))
        try:
            return path.is_file() and self.looks(path)
        except (OSError, ValueError):
            return False


def _json_with(*keys: str) -> Callable[[Path], bool]:
    def looks(path: Path) -> bool:
        data = json.loads(path.read_text(encoding="utf-8"))
        return isinstance(data, dict) and set(keys) <= data.keys()
    return looks


def _text_starting(prefix: str) -> Callable[[Path], bool]:
    def looks(path: Path) -> bool:
        with path.open("rb") as handle:
            return handle.read(len(prefix.encode())) == prefix.encode()
    return looks


def _matplotlib_png(path: Path) -> bool:
    with path.open("rb") as handle:
        head = handle.read(256)
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtSoftware\x00Matplotlib" in head


EXPORT = Output("an export written by eagle3ops", "OUT", marker="eagle3ops_export.json")
IMPORTED_DRAFTER = Output("a drafter written by eagle3ops import-drafter", "OUT", marker="eagle3ops_import.json")
COMPARISON = Output("a comparison written by eagle3ops compare", "--out",
                    only=frozenset({"compare.md", "compare.csv", "params.csv", "compare.png"}))
PROJECTION = Output("a projection written by eagle3ops project", "--out",
                    looks=_text_starting("# Projection of pipeline run "))
BENCH_RESULT = Output("a result written by eagle3ops bench", "--out", looks=_json_with("device", "size", "torch"))
BENCH_TABLE = Output("a table written by eagle3ops bench", "--out", looks=_text_starting("# eagle3ops bench: "))
PLOT = Output("a plot written by eagle3ops", "--out", looks=_matplotlib_png)
COMPAT_REPORT = Output("a report written by eagle3ops check-compat", "--json",
                       looks=_json_with("verdict", "target", "drafter", "findings"))
EXPORT_REPORT = Output("a report written by eagle3ops validate-export", "--json",
                       looks=_json_with("ok", "directory", "fmt", "target", "errors"))
REPRODUCTION = Output("a report written by eagle3ops reproduce", "--json", looks=_json_with("outputs", "metrics"))
OUTPUTS = (EXPORT, IMPORTED_DRAFTER, COMPARISON, PROJECTION, BENCH_RESULT, BENCH_TABLE, PLOT, COMPAT_REPORT,
           EXPORT_REPORT, REPRODUCTION)


def _what_is_there(path: Path, kind: Output) -> str:
    if path.is_symlink():
        return f"it is a link to {os.readlink(path)}"
    if path.is_dir():
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        if not entries:
            return "it is an empty directory"
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        return f"it holds {shown}" if kind.directory else f"it is a directory holding {shown}"
    if path.is_file():
        size = path.stat().st_size
        return f"it is a file of {size} byte{'s' if size != 1 else ''}"
    return "it is neither a file nor a directory"


def check_output(path: str | Path, kind: Output) -> None:
    """Refuse (NotOursError) unless `path` is free for an output of `kind`: absent, an empty directory (a
    directory output) or an empty file (a file output), or a previous output of that kind."""
    path = Path(path)
    if not os.path.lexists(path) or kind.recognises(path):
        return
    if not path.is_symlink() and (path.is_dir() if kind.directory else path.is_file()):
        if not (any(path.iterdir()) if kind.directory else path.stat().st_size):
            return
    raise NotOursError(f"{path} exists and is not {kind.what} ({_what_is_there(path, kind)}): choose another "
                       f"{kind.option} or remove it")


# ---------------------------------------------------------------------------------- unwritable places, a full disk

@contextmanager
def _writable(path: Path) -> Iterator[None]:
    """Creating the temporary sibling of `path`: a read-only or forbidden place is one clear line."""
    try:
        yield
    except OSError as err:
        if err.errno not in NOT_WRITABLE:
            raise
        raise NotWritableError(f"{path}: cannot write there ({err.strerror}: {err.filename or path.parent})") from None


def is_disk_full(err: BaseException) -> bool:
    """A write that failed for lack of space, as Python, torch.save or safetensors report it."""
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    return isinstance(err, Exception) and not isinstance(err, InputError) and any(
        text in str(err) for text in DISK_FULL_TEXTS)


def _existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_mib(path: str | Path) -> float:
    """The space left to unprivileged writes on the disk that holds `path` (or would)."""
    return shutil.disk_usage(_existing(Path(path))).free / 2**20


def disk_full(path: str | Path, what: str = "it", then: str = KEPT) -> DiskFullError:
    """The error for a write of `what` at `path` that ran out of space, with the space left once the partial
    write is removed: "PATH: disk full writing WHAT (N MiB free); THEN"."""
    return DiskFullError(f"{path}: disk full writing {what} ({free_mib(path):.0f} MiB free); {then}")


def probe_writable(*places: str | Path) -> None:
    """Before a stage works: each directory in `places` (or, not there yet, its nearest existing ancestor) takes a
    new file. A read-only or forbidden place (NotWritableError), a path under a file (NotWritableError) or a full
    disk (DiskFullError) is one line naming the place, before any work is lost."""
    for place in map(Path, places):
        base = _existing(place)
        if not base.is_dir():
            raise NotWritableError(f"{place}: cannot write there ({base} is a file, not a directory)")
        try:
            with tempfile.TemporaryFile(dir=base, prefix=".eagle3ops-probe.") as probe:
                probe.write(b"\0" * 4096)
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as err:
            if err.errno in NOT_WRITABLE:
                raise NotWritableError(f"{place}: cannot write there ({err.strerror}: {base})") from None
            if is_disk_full(err):
                raise disk_full(place, "a probe file", "free space and run again") from None
            raise


# ------------------------------------------------------------------------------------------------- atomic writes

def _umask() -> int:
    """The process's umask, read without setting it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _as_created(path: Path, mode: int) -> None:
    """The permissions a plain open() or mkdir() gives (mkstemp and mkdtemp make them private to the owner)."""
    os.chmod(path, mode & ~_umask())


@contextmanager
def atomic_dir(path: str | Path, kind: Output | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path`, on error it is removed (a full disk is
    a DiskFullError naming `path`). With `kind` (a path the user named), what is at `path` must be free for it or a
    previous output of that kind (check_output); without, whatever is there is replaced (a stage's own output)."""
    path = Path(path)
    if kind is not None:
        check_output(path, kind)
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        _as_created(tmp, 0o777)
        yield tmp
        if kind is not None:  # again: what a long write left time to appear there is not replaced either
            check_output(path, kind)
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        tmp.rename(path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        # a nested atomic write's DiskFullError names a place inside `tmp`, gone now: `path` instead
        if is_disk_full(err) or (isinstance(err, DiskFullError) and str(tmp) in str(err)):
            raise disk_full(path) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_path(path: str | Path, kind: Output | None = None, then: str = KEPT) -> Iterator[Path]:
    """Yield a temporary sibling file name for a writer that takes a path (torch.save); on success the file
    replaces `path`, on error it is removed (a full disk is a DiskFullError naming `path`, ending with `then`).
    `kind` as for atomic_dir."""
    path = Path(path)
    if kind is not None:
        check_output(path, kind)
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        _as_created(Path(tmp), 0o666)
        yield Path(tmp)
        if kind is not None:  # again, as atomic_dir does
            check_output(path, kind)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(err):
            raise disk_full(path, then=then) from None
        raise


def _atomic_write(path: Path, write, kind: Output | None = None) -> None:
    with atomic_path(path, kind) as tmp, tmp.open("w", encoding="utf-8") as out:
        write(out)


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    count = 0

    def write(out):
        nonlocal count
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1

    _atomic_write(Path(path), write)
    return count


def write_json_atomic(path: str | Path, obj, kind: Output | None = None) -> None:
    _atomic_write(Path(path), lambda out: out.write(json.dumps(obj, indent=2, sort_keys=True) + "\n"), kind)


def write_text_atomic(path: str | Path, text: str, kind: Output | None = None) -> None:
    _atomic_write(Path(path), lambda out: out.write(text), kind)


def link_or_copy(source: str | Path, destination: str | Path) -> None:
    """A hard link where the disk allows (a 2 GB drafter need not be stored twice), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
