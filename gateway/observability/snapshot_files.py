"""Where workers leave their snapshots for each other: one JSON file per worker in a directory.

Whichever worker answers ``/metrics`` or streams the dashboard publishes its own figures, then
adds up every file, so a scrape sees the whole gateway whatever worker the kernel picked, and
never less than the scrape before it.
A file is replaced with a rename, so a reader sees a whole snapshot, old or new, never half of
one. A worker that restarts under the same id starts from its predecessor's counters.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from pydantic import ValidationError

from gateway.observability.snapshot import WorkerSnapshot

log = logging.getLogger("gateway.observability")

ENV_METRICS_DIR = "GATEWAY_METRICS_DIR"
DIR_PREFIX = "gateway-metrics-"


def default_shared_dir(reuse_port: bool) -> Path | None:
    """``$GATEWAY_METRICS_DIR``, or for a worker of ``--workers N`` a directory named after the
    supervisor (the parent of every worker); ``None`` for a lone process."""
    configured = os.environ.get(ENV_METRICS_DIR)
    if configured:
        return Path(configured)
    if not reuse_port:
        return None
    _remove_dirs_of_gone_supervisors(_base())
    return supervisor_dir(os.getppid())


def supervisor_dir(supervisor_pid: int) -> Path:
    """The directory the workers of the supervisor ``supervisor_pid`` share (when
    ``$GATEWAY_METRICS_DIR`` names none); the supervisor removes it when it stops."""
    return _base() / f"{DIR_PREFIX}{supervisor_pid}"


def _base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _remove_dirs_of_gone_supervisors(base: Path) -> None:
    """Directories left by gateways that have exited (a supervisor cannot clean up after a
    SIGKILL); a directory whose supervisor still runs is another gateway's, and is kept."""
    for directory in base.glob(f"{DIR_PREFIX}*"):
        pid = directory.name.removeprefix(DIR_PREFIX)
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        # The workers of one gateway start together and clean the same directories: another
        # may remove this one (or its files) while we do.
        shutil.rmtree(directory, ignore_errors=True)


class SnapshotDirectory:
    __slots__ = ("_lock", "_own", "_written", "path", "worker_id")

    def __init__(self, path: Path, worker_id: int) -> None:
        self.path = path
        self.worker_id = worker_id
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._own = path / f"worker-{worker_id}.json"
        # Publishes come from the loop (scrapes) and from a thread (the tick): the number of the
        # newest snapshot written, so an older one finishing late never replaces it.
        self._lock = threading.Lock()
        self._written = 0

    def previous(self) -> WorkerSnapshot | None:
        """The last snapshot a worker with our id left, if any (we restarted)."""
        return _read(self._own)

    @property
    def written(self) -> int:
        """The number of the newest snapshot written."""
        return self._written

    def publish(self, snapshot: WorkerSnapshot, taken: int) -> None:
        """Write this worker's snapshot, the ``taken``-th this worker took (numbers grow with
        time), unless a later one is written already."""
        data = snapshot.model_dump_json().encode()
        with self._lock:
            if taken <= self._written:
                return
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".worker-{self.worker_id}.")
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                os.replace(tmp, self._own)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._written = taken

    def others(self) -> list[WorkerSnapshot]:
        """Every other worker's latest snapshot."""
        snapshots = []
        for file in sorted(self.path.glob("worker-*.json")):
            if file == self._own:
                continue
            snapshot = _read(file)
            if snapshot is not None:
                snapshots.append(snapshot)
        return snapshots


def _read(file: Path) -> WorkerSnapshot | None:
    try:
        return WorkerSnapshot.model_validate_json(file.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        # Another build's format, or a damaged file: leave it out rather than fail a scrape.
        log.warning("ignoring metrics snapshot %s: %s", file, exc)
        return None
