"""Opening files whose paths a caller names (weights from disk, LoRA folders): only regular files of
a bounded size, and never in a way that blocks.

A path may name a FIFO (opening it for reading waits for a writer, forever), a device such as
/dev/urandom or /dev/zero (reading never ends), a directory, or a sparse file that claims a huge
size. Each is refused with a ValueError that names the path and what it is. The check is made on
the opened descriptor (`O_NONBLOCK`, so a FIFO cannot block the open), so a path swapped between a
check and the read cannot slip through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | Path, what: str, max_bytes: int | None = None) -> Path:
    """`path`, if it is a regular file (after following links) of at most `max_bytes`; else
    ValueError naming `what`, the path and what it is."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist") from None
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {error.strerror}") from None
    _check_info(path, info, what, max_bytes)
    return path


def open_regular(path: str | Path, what: str, max_bytes: int | None = None) -> BinaryIO:
    """`path` opened for reading, once the opened file shows it is regular and small enough."""
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist") from None
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} cannot be opened: {error.strerror}") from None
    try:
        _check_info(path, os.fstat(descriptor), what, max_bytes)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(path: str | Path, what: str, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes`."""
    with open_regular(path, what, max_bytes) as handle:
        return handle.read(max_bytes + 1)


def _check_info(path: Path, info: os.stat_result, what: str, max_bytes: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {str(path)!r} is {kind_of(info.st_mode)}, not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{what} {str(path)!r} is {info.st_size} bytes, more than the {max_bytes} it may have")
