"""The shared state's runtime directories: claimed (locked, emptied, the first map reserved),
and another gateway's left alone while any of its processes holds it, even once its
supervisor is gone. Real processes hold the locks; no clock is involved."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.stores.shared.runtime_dir import (
    CLAIM_FILE,
    DIR_PREFIX,
    ENV_SHARED_DIR,
    SharedDirError,
    claim_runtime_dir,
    release_runtime_dir,
    runtime_dir,
)
from gateway.stores.shared.space import FIRST_MAP_BYTES

pytestmark = pytest.mark.reliability

# Holds an flock on argv[1] until its stdin closes: a gateway's orphaned worker, as far as the
# directory can tell.
HOLDER = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def gone_pid() -> int:
    """The pid of a process that has exited (its supervisor, killed)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def left_by(base: Path, pid: int, *, claimed: bool) -> Path:
    directory = base / f"{DIR_PREFIX}{pid}"
    directory.mkdir()
    (directory / "data.mdb").write_bytes(b"state")
    if claimed:
        (directory / CLAIM_FILE).touch()
    return directory


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(ENV_SHARED_DIR, str(tmp_path))
    yield tmp_path


def test_a_directory_held_by_orphaned_workers_is_kept_and_cannot_be_claimed(base: Path) -> None:
    """Three directories whose supervisors are gone: one whose lock a live process holds is
    kept (before: removed under the workers using it), one unlocked and one from before the
    locks are removed. Claiming the held one is refused in one line."""
    held = left_by(base, gone_pid(), claimed=True)
    abandoned = left_by(base, gone_pid(), claimed=True)
    unclaimed = left_by(base, gone_pid(), claimed=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(held / CLAIM_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    own = runtime_dir(os.getpid())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        claim_runtime_dir(own)
        assert held.is_dir() and (held / "data.mdb").read_bytes() == b"state"
        assert not abandoned.exists() and not unclaimed.exists()
        data = os.stat(own / "data.mdb")
        assert data.st_size == FIRST_MAP_BYTES and data.st_blocks * 512 >= FIRST_MAP_BYTES
        with pytest.raises(SharedDirError) as refused:
            claim_runtime_dir(held)
        assert str(refused.value) == f"{held}: held by another gateway's processes"
    finally:
        release_runtime_dir(own)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()
    assert not own.exists()
    claim_runtime_dir(own)  # once the holder is gone, the next start takes its place
    release_runtime_dir(own)
    assert not held.exists()


def test_a_claimed_directory_starts_empty(base: Path) -> None:
    """What a previous gateway of the same pid left is not read (state starts empty)."""
    own = runtime_dir(os.getpid())
    own.mkdir()
    (own / "data.mdb").write_bytes(b"old state")
    (own / "stale").mkdir()
    claim_runtime_dir(own)
    try:
        assert sorted(p.name for p in own.iterdir()) == sorted([CLAIM_FILE, "data.mdb", "lock.mdb"])
        assert (own / "data.mdb").read_bytes()[:9] != b"old state"
    finally:
        release_runtime_dir(own)
