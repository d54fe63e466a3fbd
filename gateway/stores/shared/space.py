"""Room on the filesystem for the shared store's memory map, reserved before it is used.

LMDB maps its data file with ``writemap``: a page is written through the map, and on a
filesystem that cannot back it (a full tmpfs such as ``/dev/shm``) the kernel answers with
SIGBUS, which kills the worker. So no page is mapped before the filesystem has allocated it:
the data file is allocated (``posix_fallocate``) to the map's size before LMDB may use that
size, and the map grows only the same way, a step at a time (``SharedStore``). A step that
cannot be allocated is an error the caller handles, never a signal.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Final

import lmdb

DATA_FILE: Final = "data.mdb"  # LMDB's names in an environment directory
LOCK_FILE: Final = "lock.mdb"
# The map's first size: the store's metadata and some tens of thousands of short keys. Small
# enough for a container's default 64 MiB /dev/shm; the map doubles from there as it fills.
FIRST_MAP_BYTES: Final = 8 << 20
# LMDB's lock file holds the reader table (``max_readers`` slots of 64 bytes), mapped too.
LOCK_FILE_BYTES: Final = 64 << 10


class NoRoom(Exception):
    """The filesystem cannot hold what the map needs."""

    def __init__(self, directory: Path, needed: int, free: int) -> None:
        super().__init__(
            f"{directory}: the shared limit state needs {size_text(needed)} there, "
            f"{size_text(free)} free"
        )
        self.directory = directory
        self.needed = needed
        self.free = free


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def free_bytes(directory: Path) -> int:
    """What an unprivileged process may still allocate there."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def reserve(path: Path, size: int) -> int:
    """Allocate ``path``'s first ``size`` bytes (creating it), so that a map of that size
    is backed page for page; returns the file's size after (it never shrinks). Raises
    ``NoRoom`` when the filesystem cannot hold them (nothing of this call's allocation kept
    on tmpfs)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        before = os.fstat(fd)
        try:
            # Over pages already allocated too: a hole left by anything else is filled.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            needed = size - min(before.st_blocks * 512, size)
            raise NoRoom(path.parent, needed, free_bytes(path.parent)) from None
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def create_map(directory: Path) -> None:
    """An empty environment in ``directory`` with its first map reserved: LMDB writes its
    first pages with write(2), not through a map (a full disk is an error then, not a
    signal); then the data file is allocated. (Allocated first, the file would be zeros,
    which LMDB refuses as not one of its files.) The lock file, mapped as well, is allocated
    before LMDB sizes it, and keeps the size it is given."""
    reserve(directory / LOCK_FILE, LOCK_FILE_BYTES)
    try:
        lmdb.open(str(directory), map_size=FIRST_MAP_BYTES, max_dbs=4, lock=False).close()
    except lmdb.Error as exc:
        free = free_bytes(directory)
        if free < FIRST_MAP_BYTES:
            raise NoRoom(directory, FIRST_MAP_BYTES, free) from None
        raise OSError(errno.EIO, str(exc)) from None
    reserve(directory / DATA_FILE, FIRST_MAP_BYTES)


def reserved_size(path: Path) -> int:
    """The data file's size: every process maps exactly this much, never more."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
