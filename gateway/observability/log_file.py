"""The access log's file: appended to by every worker, reopened on SIGUSR1 (logrotate).

Each line is one ``write`` on a descriptor opened with ``O_APPEND``: the kernel appends it
whole, at the end, so the workers of one gateway (each with its own descriptor) share the file
without a lock and without interleaving their lines, on a local filesystem (not over NFS).
Nothing is buffered in the process: a line is in the file (the page cache) once the request is
logged, as on stderr before, and no line is left behind by a crash or a reopen.

A reopen opens the path again, then swaps the descriptors: after logrotate renames the file,
the lines written before the signal are in the renamed file and those after it in the new
one. If the path cannot be opened, the old descriptor stays (and says why once).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Final

from gateway.log_throttle import LogThrottle

log = logging.getLogger("gateway")
_FLAGS: Final = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
# Readable by the file's group (adm, syslog): the log holds no secret (API keys are hashed).
FILE_MODE: Final = 0o640


class LogFile:
    """An append-only file of lines, reopened by ``reopen``."""

    __slots__ = ("_fd", "_throttle", "lost", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, _FLAGS, FILE_MODE)  # OSError: the caller says where
        self._throttle = LogThrottle(log)
        self.lost = 0  # lines a failed write dropped

    def write(self, data: bytes) -> None:
        """Append one or more whole lines. A failure (a full disk) drops them, counted, and is
        logged once per cause every 10 s: a request is never failed for its log line."""
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # a regular file short-writes only as it fills up
                data = data[written:]
                written = os.write(self._fd, data)
        except OSError as failed:
            self.lost += 1
            cause = failed.errno or 0
            if self._throttle.due(cause):
                self._throttle.log(
                    logging.ERROR,
                    cause,
                    f"access log {self.path}: cannot write: "
                    f"{failed.strerror or errno.errorcode.get(cause, str(failed))} "
                    f"({self.lost} lines lost so far)",
                )

    def reopen(self) -> None:
        """Open the path again (after logrotate renamed the file) and write there from now on;
        OSError, and the old file kept, when it cannot be opened."""
        fd = os.open(self.path, _FLAGS, FILE_MODE)
        old, self._fd = self._fd, fd
        os.close(old)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
