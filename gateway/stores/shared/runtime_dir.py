"""Where the workers of one gateway keep their shared limit state: a directory per supervisor
(or lone process), claimed at start and removed at exit.

Claiming a directory locks it (``flock`` on a file in it, taken by the supervisor and inherited
by its workers, so held until the last of them exits, orphaned workers included), empties it,
and reserves the room its first map needs on the filesystem (``space``). The directories of
gateways that are gone are removed on the way; one whose lock is still held is another
gateway's, even if its supervisor was killed, and is left alone.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

from gateway.stores.shared.space import NoRoom, create_map

ENV_SHARED_DIR: Final = "GATEWAY_SHARED_DIR"
DIR_PREFIX: Final = "gateway-limits-"
CLAIM_FILE: Final = "gateway.lock"

# The claims this process holds (their descriptors stay open until it exits).
_claims: dict[Path, int] = {}


class SharedDirError(Exception):
    """The shared state's directory cannot be used: one line saying why and where."""


def _base() -> tuple[Path, str]:
    """The directory the runtime directories go in, and how to name it in a message."""
    configured = os.environ.get(ENV_SHARED_DIR)
    if configured:
        return Path(configured), f"{ENV_SHARED_DIR} {configured}"
    if Path("/dev/shm").is_dir():
        return Path("/dev/shm"), "/dev/shm"
    temp = tempfile.gettempdir()
    return Path(temp), temp


def runtime_dir(supervisor_pid: int | None = None) -> Path:
    """The directory of one gateway's shared state, named after its supervisor, under
    ``$GATEWAY_SHARED_DIR``, else ``/dev/shm`` (a temporary directory when there is none)."""
    return _base()[0] / f"{DIR_PREFIX}{supervisor_pid or os.getpid()}"


def worker_runtime_dir(workers: int) -> Path:
    """Where this process finds the shared state: a worker of ``--workers N`` its
    supervisor's directory (claimed by the supervisor before it started the workers), a lone
    process its own, claimed now."""
    if workers > 1:
        return runtime_dir(os.getppid())
    path = runtime_dir(os.getpid())
    if path not in _claims:
        claim_runtime_dir(path)
        atexit.register(release_runtime_dir, path)
    return path


def claim_runtime_dir(path: Path) -> None:
    """Lock ``path`` for this process and those it forks, empty it and reserve its first map;
    raises ``SharedDirError``. Claiming it again in the same process changes nothing."""
    if path in _claims:
        return
    base, named = _base()
    try:
        base.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SharedDirError(f"{named}: not a directory") from None
    except OSError as exc:
        raise SharedDirError(f"{named}: cannot create it: {_reason(exc)}") from None
    if not base.is_dir():
        raise SharedDirError(f"{named}: not a directory")
    _remove_dirs_of_gone_gateways(base)
    fd = -1
    try:
        path.mkdir(exist_ok=True)
        fd = os.open(path / CLAIM_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SharedDirError(f"{path}: held by another gateway's processes") from None
        # Start from empty state, as in-process state does: nothing a previous gateway of
        # this pid left is read.
        for child in path.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            elif child.name != CLAIM_FILE:
                child.unlink()
        create_map(path)
    except NoRoom as exc:
        _release(fd)
        raise SharedDirError(f"{exc} (set {ENV_SHARED_DIR} to a directory with room)") from None
    except OSError as exc:
        _release(fd)
        raise SharedDirError(
            f"{named}: cannot keep the shared limit state there: {_reason(exc)}"
        ) from None
    except BaseException:
        _release(fd)
        raise
    _claims[path] = fd


def release_runtime_dir(path: Path) -> None:
    """Remove a directory this process claimed (at exit, its workers gone)."""
    shutil.rmtree(path, ignore_errors=True)
    _release(_claims.pop(path, -1))


def _release(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _remove_dirs_of_gone_gateways(base: Path) -> None:
    """Remove what gateways that have exited left (one killed cannot clean up after
    itself): a directory whose claim nobody holds and whose creator is gone."""
    for directory in base.glob(f"{DIR_PREFIX}*"):
        pid = directory.name.removeprefix(DIR_PREFIX)
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            fd = os.open(directory / CLAIM_FILE, os.O_RDONLY)
        except FileNotFoundError:
            shutil.rmtree(directory, ignore_errors=True)  # left by a gateway without claims
            continue
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its workers still run: the state is theirs
            shutil.rmtree(directory, ignore_errors=True)
        finally:
            os.close(fd)


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)
