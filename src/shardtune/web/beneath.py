"""Reading a run folder's files without following a symbolic link.

The page shows what run folders hold (configs, errors, console output) to whoever has its token, and anyone who can
write into a folder under ROOT could leave a link there: ``shardtune_config.json -> ~/.ssh/id_rsa`` would be shown
as the run's config. So every file is opened one path component at a time relative to the folder's descriptor with
``O_NOFOLLOW``: a link anywhere below the folder is refused (shardtune writes none), and no component can be swapped
for one between a check and the open.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted there must not block a read


@contextlib.contextmanager
def _folder_fd(folder: Path, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of ``folder/parts...``, each component opened without following a link."""
    fd = os.open(folder, _DIRECTORY)
    try:
        for part in parts:
            if part in ("", ".", ".."):
                raise PermissionError(f"{part!r}: not a name inside the folder")
            inner = os.open(part, _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _parts(relative: str | Path) -> tuple[str, ...]:
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute():
        raise PermissionError(f"{relative}: not a path inside the folder")
    return parts


def open_beneath(folder: Path, relative: str | Path) -> BinaryIO:
    """``folder/relative`` opened for reading (binary), refused (OSError) when any component below ``folder`` is a
    symbolic link, or when it is not a regular file."""
    *dirs, name = _parts(relative)
    with _folder_fd(folder, tuple(dirs)) as parent:
        if name in (".", ".."):
            raise PermissionError(f"{relative}: not a file inside the folder")
        fd = os.open(name, _FILE, dir_fd=parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{relative}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text_beneath(folder: Path, relative: str | Path, limit: int | None = None) -> str:
    """The text of ``folder/relative`` (its last ``limit`` bytes when given), as open_beneath opens it."""
    with open_beneath(folder, relative) as f:
        if limit is not None:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
        return f.read().decode("utf-8", errors="replace")


def list_beneath(folder: Path, relative: str | Path) -> list[str]:
    """The names in the folder ``folder/relative`` (empty when it is missing or reached through a link)."""
    try:
        with _folder_fd(folder, _parts(relative)) as fd:
            return os.listdir(fd)
    except OSError:
        return []


class AppendedLines:
    """The complete lines appended to ``folder/relative`` since the last call, so a live page reads only what is
    new. A file that shrank or was replaced (another run into the same output_dir) is read again from its start."""

    def __init__(self, folder: Path, relative: str | Path) -> None:
        self.folder, self.relative = folder, relative
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.partial = b""

    def read(self) -> tuple[list[str], bool]:
        """(the new complete lines, whether the file was read afresh); no lines when it cannot be read."""
        try:
            with open_beneath(self.folder, self.relative) as f:
                status = os.fstat(f.fileno())
                identity = (status.st_dev, status.st_ino)
                restarted = identity != self.identity or status.st_size < self.offset
                if restarted:
                    self.offset, self.partial, self.identity = 0, b"", identity
                if status.st_size == self.offset:
                    return [], restarted
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return [], False
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # a line still being written
        return [line.decode("utf-8", errors="replace") for line in lines if line.strip()], restarted
