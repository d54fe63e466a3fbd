"""TLS on the client listener, and its certificate swapped without dropping a connection.

The listening socket keeps the context it was opened with; that context's SNI callback, which
OpenSSL calls on every ClientHello (with or without a server name), hands each new handshake
the context of the latest pair that loaded. Connections already open keep theirs. A new pair is
read when its files change (checked every second: a rename, a symlink swap as a Kubernetes
Secret does, a rewrite) and on SIGHUP; one that does not load (unreadable, the key not the
certificate's, expired) is refused with one line and the pair in use stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from pathlib import Path
from typing import Final

from gateway.policy.models import TlsSettings
from gateway.policy.tls_files import (
    TlsFilesError,
    file_signature,
    load_tls,
    minimum_version,
    tls_paths,
)

log = logging.getLogger("gateway.tls")
_SETTLE_S: Final = 0.2


class ListenerTls:
    """The listener's TLS: ``context`` to listen with, ``reload`` to take in new files."""

    def __init__(self, settings: TlsSettings, policy_file: str) -> None:
        pair = load_tls(settings, policy_file)  # TlsFilesError: the gateway does not start
        self.context = pair.context
        self.context.sni_callback = self._choose
        self._current = pair
        self._settings = settings
        self._policy_file = policy_file
        self._seen = file_signature((pair.cert, pair.key))
        self.reloads: dict[str, int] = {"ok": 0, "failed": 0}
        self.last_error: str | None = None

    @property
    def not_after(self) -> float:
        """When the certificate in use expires (Unix time)."""
        return self._current.not_after

    @property
    def files(self) -> tuple[Path, Path]:
        return self._current.cert, self._current.key

    def _choose(self, ssl_object: ssl.SSLObject, server_name: str | None, _: object) -> None:
        current = self._current.context
        if ssl_object.context is not current:
            ssl_object.context = current

    def reload(self, settings: TlsSettings | None = None, policy_file: str | None = None) -> bool:
        """Load the pair again (with new settings, from a reloaded policy); False, logged and
        counted, if it does not load: the pair in use stays."""
        settings = settings or self._settings
        policy_file = policy_file or self._policy_file
        try:
            pair = load_tls(settings, policy_file)
        except TlsFilesError as exc:
            self.reloads["failed"] += 1
            self.last_error = str(exc)
            log.error("TLS certificate not reloaded, the one in use stays: %s", exc)
            return False
        self.context.minimum_version = minimum_version(settings)  # new handshakes negotiate by it
        self._current = pair
        self._settings = settings
        self._policy_file = policy_file
        self._seen = file_signature((pair.cert, pair.key))
        self.reloads["ok"] += 1
        self.last_error = None
        log.info(
            "TLS certificate %s loaded (expires %s)",
            pair.cert,
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(pair.not_after)),
        )
        return True

    def files_named(self) -> tuple[Path, ...]:
        return tls_paths(self._settings, self._policy_file)

    async def watch(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """Reload whenever the files change; runs until ``stop`` is set."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
            if stop.is_set():
                return
            signature = file_signature(self.files_named())
            if signature == self._seen:
                continue
            # A rotation writes the certificate and the key one after the other: read them
            # once neither has changed for a moment, not half-way.
            await asyncio.sleep(_SETTLE_S)
            settled = file_signature(self.files_named())
            if settled != signature:
                continue
            # Refused or loaded, this version of the files is not read again.
            self._seen = settled
            self.reload()
