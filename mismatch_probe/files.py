"""Reading the user's text files, writing run and sweep files atomically, and writing paths into
records so that they travel.

All sit at the bottom of the package (they import nothing of ours but :mod:`errors`): every
layer that reads a spec, a prompts file or a thresholds file, writes a file of a run or sweep
directory, or records a path, uses them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mismatch_probe.errors import ConfigError


def not_utf8(path: str | Path, exc: UnicodeDecodeError, data: bytes, *, line: int | None = None) -> ConfigError:
    """The one-line error for a file that is not UTF-8: where the first bad byte is, and the fix."""
    if line is None:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    else:
        column = exc.start + 1
    return ConfigError(
        f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})",
        hint=f"save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > fixed{Path(path).suffix}",
    )


def read_text(path: str | Path, what: str) -> str:
    """A user's UTF-8 text file (spec, thresholds); a :class:`ConfigError` naming the file, never
    a traceback, when it cannot be read or is not UTF-8."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {p}: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(p, exc, data) from None


def portable_path(path: str | Path, base: str | Path | None = None) -> str:
    """``path`` as recorded in run.json: relative to ``base`` (default: the working directory)
    when it lies under it, so that a committed or copied run directory carries no machine's
    absolute paths; otherwise absolute, since nothing shorter would find it again."""
    p = Path(os.path.abspath(path))
    b = Path(os.path.abspath(base if base is not None else os.getcwd()))
    try:
        return p.relative_to(b).as_posix() or "."
    except ValueError:
        return str(p)


def relative_to_dir(path: str | Path, directory: str | Path) -> str:
    """``path`` relative to ``directory`` (``..`` allowed): how one run directory names another, so
    that moving them together keeps the link."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(directory))).as_posix()


def resolve_from_dir(directory: str | Path, recorded: str) -> Path:
    """A path recorded by :func:`relative_to_dir` (or an absolute one, as older records hold),
    back as an absolute path."""
    return Path(os.path.normpath(Path(os.path.abspath(directory)) / recorded))


# ---- atomic writes ----------------------------------------------------------------------------


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block ends
    without an error, removed otherwise. A reader (or a resumed run) therefore sees the previous
    file or the new one, never half of one, whatever kills the writer. The temporary name is
    hidden (a leading dot: Arrow's dataset reader skips it) and unique to this call, so two
    writers of one file never share a temporary file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # not mkstemp: its files are private (0600), and a report must keep the umask's permissions
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # after a successful rename there is nothing left to remove


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (:func:`atomic_path`); returns ``path``."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)
