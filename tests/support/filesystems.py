"""A full disk made for real: a small tmpfs mounted for a test, and a file that fills it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted at ``path`` for the block. Needs root
    and a kernel that lets this process mount (CI runs as root); the test is skipped, saying
    so, where it cannot."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        reason = mounted.stderr.strip() or f"exit {mounted.returncode}"
        pytest.skip(f"cannot mount a tmpfs here ({reason}): full-disk cases need root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill_to(directory: Path, leave_bytes: int) -> Path:
    """Allocate a file in ``directory`` so that ``leave_bytes`` stay free; the file."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    with filler.open("wb") as out:
        os.posix_fallocate(out.fileno(), 0, stat.f_bavail * stat.f_frsize - leave_bytes)
    return filler
