"""Live policy reload: on file change (watched by directory, so rename-replace by editors and
Kubernetes config maps is seen) and on SIGHUP. A new policy is validated in full and built before
it is swapped in; an invalid one is logged and counted, and the running policy stays.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import watchfiles

from gateway.engine.preflight import load_and_build
from gateway.policy.loader import LoadedPolicy, PolicyError
from gateway.policy.reload_status import ReloadStatus

log = logging.getLogger("gateway.reload")
# watchfiles logs every batch of changes it sees at INFO. The directory it watches may hold the
# gateway's own log file: each such line would be the next change, about 10 lines a second
# forever. Our reloads log what matters.
logging.getLogger("watchfiles").setLevel(logging.WARNING)


class PolicyReloader:
    """Reloads one policy file: given the policy in force (``running``), what swaps in a new
    one (``apply``, which raises ``ValueError`` and changes nothing if it cannot), and what
    reads again the files the policy names but whose content is not in it (``refresh``: the
    admin token file; True if what it read changed what is in force, ``ValueError`` and nothing
    changed if it cannot), which the policy's hash cannot see change."""

    def __init__(
        self,
        path: str | Path,
        *,
        running: Callable[[], LoadedPolicy],
        apply: Callable[[LoadedPolicy], None],
        refresh: Callable[[], bool] | None = None,
    ) -> None:
        self._running = running
        self._apply = apply
        self._refresh = refresh
        self.path = Path(path)
        self.status = ReloadStatus(last_success_at=time.time())
        self._lock = asyncio.Lock()
        # The file as it was when the running policy was read: a later change is caught even
        # if it happened before the watcher got going.
        self._seen = self._file_signature()

    async def reload(self) -> str:
        """Try to load the file now; returns 'ok', 'unchanged' or 'failed'. An unchanged
        policy whose token file changed is 'ok' too: the token is rotated."""
        async with self._lock:
            self._update(last_attempt_at=time.time())
            try:
                loaded = load_and_build(self.path)
                if loaded.sha256 == self._running().sha256:
                    if self._refresh is not None and self._refresh():
                        self._update(succeeded=self.status.succeeded + 1)
                        self._succeeded()
                        log.info(
                            "policy %s unchanged (sha256 %s); the admin token file or the JWT "
                            "key file changed: the token is rotated",
                            self.path,
                            loaded.sha256[:12],
                        )
                        return "ok"
                    self._update(unchanged=self.status.unchanged + 1)
                    if self.status.last_result == "failed":
                        # The bad edit was reverted: the file and the running policy agree
                        # again, so the stale failure must not stay on /policy and the dashboard.
                        self._succeeded()
                        log.info(
                            "policy %s is back to the running policy (sha256 %s); "
                            "the earlier reload failure is cleared",
                            self.path,
                            loaded.sha256[:12],
                        )
                    else:
                        log.info("policy %s unchanged (sha256 %s)", self.path, loaded.sha256[:12])
                    return "unchanged"
                self._apply(loaded)
            except (PolicyError, ValueError) as exc:
                self._update(
                    failed=self.status.failed + 1, last_result="failed", last_error=str(exc)
                )
                log.error(
                    "policy reload failed, keeping the running policy: %s",
                    "; ".join(str(exc).splitlines()),
                )
                return "failed"
            self._update(succeeded=self.status.succeeded + 1)
            self._succeeded()
            log.info("policy reloaded from %s (sha256 %s)", self.path, loaded.sha256[:12])
            for line in loaded.warning_lines():
                log.warning("%s", line)
            return "ok"

    def _succeeded(self) -> None:
        self._update(last_result="ok", last_error=None, last_success_at=time.time())

    def _update(self, **changes: Any) -> None:
        self.status = self.status.model_copy(update=changes)

    def _file_signature(self) -> tuple[tuple[int, int, int] | None, ...]:
        """The policy file's, then those of the files it names (``overrides_file``)."""
        paths: tuple[str | Path, ...] = (self.path, *self._running().files)
        return tuple(_signature(path) for path in paths)

    async def watch(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """Reload whenever the file's directory changes; runs until ``stop`` is set.

        Directory events catch rename-replace edits; a stat check every ``poll_s`` catches what
        events miss (a change made while the watcher was starting, filesystems without inotify).
        """
        directory = self.path.resolve().parent
        names = {self.path.name, self.path.resolve().name}
        # The files the policy names that live beside it (others are caught by the stat check).
        names |= {Path(path).name for path in self._running().files}
        async for changes in watchfiles.awatch(
            directory,
            watch_filter=None,
            stop_event=stop,
            debounce=200,
            step=50,
            recursive=False,
            rust_timeout=round(poll_s * 1000),
            yield_on_timeout=True,
        ):
            current = self._file_signature()
            # Only the policy file's own events count (and Kubernetes' "..data" swaps): other
            # files in the directory, a log file say, must not trigger reloads, each of which
            # logs a line (a log file beside the policy would otherwise reload in a loop).
            if current != self._seen or any(_concerns(path, names) for _, path in changes):
                self._seen = current
                await self.reload()


def _signature(path: str | Path) -> tuple[int, int, int] | None:
    try:
        stat = Path(path).stat()  # follows symlinks: a config map swaps the target
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _concerns(path: str, names: set[str]) -> bool:
    name = Path(path).name
    return name in names or name.startswith("..")
