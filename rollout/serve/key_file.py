"""The file a server writes its generated API key to, and removes at exit.

The file is always a new one, readable and writable by this user only (as Jupyter writes its
tokens), made without following links: in a folder others can write to, a link planted at the
path would have the key written wherever it points, and a file another user made (left readable to
them) would hand them the key. A file of this user's there (a key left by a server that was
killed) is replaced; anything else there, or a folder others may change, is refused.

The folder is opened once, when the key is written, and the file is made and removed through
that descriptor: a path that reaches the folder through a link (a linked ~/.cache) is followed
once, then, and never again. Removing by path at exit once deleted a file of the same name in the
folder the link pointed to by then. And the file is removed only if it is still the one written.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class KeyFile:
    """A generated key (`key`) and the file it was written to (`path`: its folder's real path then)."""

    def __init__(self, key: str, folder: int, name: str, written: os.stat_result, path: Path):
        self.key, self.path = key, path
        self._folder, self._name = folder, name
        self._identity = _identity(written)

    def remove(self) -> None:
        """Remove the file from the folder it was written in, if it is still the file written
        (idempotent: a second call, or one after someone removed it, does nothing)."""
        if self._folder < 0:
            return
        try:
            info = os.stat(self._name, dir_fd=self._folder, follow_symlinks=False)
            if _identity(info) == self._identity:
                os.unlink(self._name, dir_fd=self._folder)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._folder)
            self._folder = -1


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    """What tells the file written from one made later under its name (which may reuse its inode)."""
    return info.st_dev, info.st_ino, info.st_ctime_ns


def write_generated_key(path: Path) -> KeyFile:
    """A fresh key, written to a new file at `path` (the folder made private too if this makes it);
    ValueError for a path or folder that is refused (see the module's doc)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check_key_folder(os.fstat(folder), path.parent)
        key = secrets.token_urlsafe(32)
        written = _write_new(folder, path, key)
        return KeyFile(key, folder, path.name, written, Path(os.path.realpath(path.parent)) / path.name)
    except BaseException:
        os.close(folder)
        raise


def _write_new(folder: int, path: Path, key: str) -> os.stat_result:
    """Write `key` to a new file named like `path` in `folder` (a descriptor); its stat."""
    try:
        existing = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISREG(existing.st_mode) or existing.st_uid != os.geteuid():
            what = "a symbolic link" if stat.S_ISLNK(existing.st_mode) else "not a regular file of this user's"
            raise ValueError(
                f"--api-key-file {path} exists and is {what} (owner uid {existing.st_uid}): the key is written only "
                "to a new file; remove it, or name another file"
            )
        os.unlink(path.name, dir_fd=folder)  # a new file, not this one: whoever opened it before reads nothing
    try:
        descriptor = os.open(path.name, _NEW_FILE, 0o600, dir_fd=folder)
    except FileExistsError:
        raise ValueError(f"--api-key-file {path} was made by someone else while this server wrote it") from None
    try:
        os.fchmod(descriptor, 0o600)  # whatever the umask
        os.write(descriptor, key.encode())
        return os.fstat(descriptor)
    finally:
        os.close(descriptor)


def _check_key_folder(info: os.stat_result, folder: Path) -> None:
    """The key file's folder must be this user's (or root's), and if others may write to it, sticky
    (/tmp): otherwise another user could swap the key file for one of theirs after it is written."""
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if info.st_uid not in (os.geteuid(), 0) or writable_by_others and not info.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"--api-key-file: its folder {folder} belongs to uid {info.st_uid} with mode "
            f"{stat.filemode(info.st_mode)}: others could replace the key file; use a folder of your own"
        )
