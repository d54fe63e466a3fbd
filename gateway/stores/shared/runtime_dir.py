"""Where the workers of one gateway keep their shared limit state: a directory per supervisor,
cleaned at start, and the directories of supervisors that are gone removed."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

ENV_SHARED_DIR: Final = "GATEWAY_SHARED_DIR"
DIR_PREFIX: Final = "gateway-limits-"


def runtime_dir(supervisor_pid: int | None = None) -> Path:
    """The directory of one gateway's shared state, named after its supervisor, under
    ``$GATEWAY_SHARED_DIR``, else ``/dev/shm`` (a temporary directory when there is none)."""
    configured = os.environ.get(ENV_SHARED_DIR)
    if configured:
        base = Path(configured)
    elif Path("/dev/shm").is_dir():
        base = Path("/dev/shm")
    else:
        base = Path(tempfile.gettempdir())
    return base / f"{DIR_PREFIX}{supervisor_pid or os.getpid()}"


def worker_runtime_dir(workers: int) -> Path:
    """Where this process finds the shared state: a worker of ``--workers N`` its
    supervisor's directory (cleaned by the supervisor before it started the workers), a lone
    process its own, cleaned now."""
    if workers > 1:
        return runtime_dir(os.getppid())
    path = runtime_dir(os.getpid())
    clean_runtime_dir(path)
    return path


def clean_runtime_dir(path: Path) -> None:
    """Start from empty state: remove what a previous gateway left, and the directories of
    supervisors that have exited (one killed cannot clean up after itself)."""
    shutil.rmtree(path, ignore_errors=True)
    for directory in path.parent.glob(f"{DIR_PREFIX}*"):
        pid = directory.name.removeprefix(DIR_PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(directory, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
