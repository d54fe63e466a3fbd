"""TLS on a client listener: its certificates chosen by SNI, each swapped without dropping a
connection.

The listening socket keeps the context it was opened with; that context's SNI callback, which
OpenSSL calls on every ClientHello (with or without a server name), hands each new handshake
the context of the certificate for the name asked (an exact name, else the longest wildcard
over it, else the default), as last loaded. Connections already open keep theirs. A
certificate is read again when its files change (checked every second: a rename, a symlink
swap as a Kubernetes Secret does, a rewrite) and on SIGHUP; one that does not load
(unreadable, the key not the certificate's, expired) is refused with one line and the one in
use stays. The others are not touched.
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
    TlsPair,
    certificate_paths,
    file_signature,
    load_pair,
    load_tls,
    minimum_version,
)

log = logging.getLogger("gateway.tls")
_SETTLE_S: Final = 0.2


class ServerNames:
    """Which certificate a server name gets: its exact name, else the longest wildcard over
    it (``*.example.com``: any name under example.com, as nginx's server_name), else the
    default."""

    __slots__ = ("_default", "_exact", "_wildcards")

    def __init__(self, settings: TlsSettings) -> None:
        self._default = settings.default_index
        self._exact: dict[str, int] = {}
        wildcards: list[tuple[str, int]] = []
        for index, certificate in enumerate(settings.chain_files):
            for name in certificate.server_names:
                if name.startswith("*."):
                    wildcards.append((name[1:], index))  # ".example.com"
                else:
                    self._exact[name] = index
        self._wildcards = sorted(wildcards, key=lambda item: -len(item[0]))

    def index_for(self, server_name: str | None) -> int:
        if not server_name:
            return self._default
        name = server_name.lower().rstrip(".")
        index = self._exact.get(name)
        if index is not None:
            return index
        for suffix, wildcard_index in self._wildcards:
            if name.endswith(suffix):
                return wildcard_index
        return self._default


class ListenerTls:
    """One listener's TLS: ``context`` to listen with, ``reload`` to take in new files."""

    def __init__(self, settings: TlsSettings, policy_file: str) -> None:
        pairs = load_tls(settings, policy_file)  # TlsFilesError: the gateway does not start
        self.context = pairs[settings.default_index].context
        self.context.sni_callback = self._choose
        self.reloads: dict[str, int] = {"ok": 0, "failed": 0}
        self.last_error: str | None = None
        self._install(settings, policy_file, pairs)

    def _install(self, settings: TlsSettings, policy_file: str, pairs: tuple[TlsPair, ...]) -> None:
        self._settings = settings
        self._policy_file = policy_file
        self._names = ServerNames(settings)
        self._pairs = list(pairs)
        self._seen = [file_signature((pair.cert, pair.key)) for pair in pairs]

    @property
    def not_after(self) -> float:
        """When the first of its certificates in use expires (Unix time)."""
        return min(pair.not_after for pair in self._pairs)

    @property
    def files(self) -> tuple[Path, Path]:
        """The default certificate's files."""
        default = self._pairs[self._settings.default_index]
        return default.cert, default.key

    @property
    def certificates(self) -> int:
        return len(self._pairs)

    def _choose(self, ssl_object: ssl.SSLObject, server_name: str | None, _: object) -> None:
        chosen = self._pairs[self._names.index_for(server_name)].context
        if ssl_object.context is not chosen:
            ssl_object.context = chosen

    def reload(self, settings: TlsSettings | None = None, policy_file: str | None = None) -> bool:
        """Load the certificates again: all at once, refused whole, with new settings (from a
        reloaded policy); one by one otherwise (SIGHUP). False, logged and counted, for one
        that does not load: the one in use stays."""
        if settings is None and policy_file is None:
            results = [self._reload_one(index) for index in range(len(self._pairs))]
            return all(results)
        settings = settings or self._settings
        policy_file = policy_file or self._policy_file
        try:
            pairs = load_tls(settings, policy_file)
        except TlsFilesError as exc:
            self._refused(exc)
            return False
        self.context.minimum_version = minimum_version(settings)  # new handshakes negotiate by it
        self._install(settings, policy_file, pairs)
        for pair in pairs:
            self._loaded(pair)
        return True

    def _reload_one(self, index: int) -> bool:
        certificate = self._settings.chain_files[index]
        try:
            pair = load_pair(certificate, self._settings, self._policy_file)
        except TlsFilesError as exc:
            self._refused(exc)
            return False
        self._pairs[index] = pair
        self._seen[index] = file_signature((pair.cert, pair.key))
        self._loaded(pair)
        return True

    def _refused(self, exc: TlsFilesError) -> None:
        self.reloads["failed"] += 1
        self.last_error = str(exc)
        log.error("TLS certificate not reloaded, the one in use stays: %s", exc)

    def _loaded(self, pair: TlsPair) -> None:
        self.reloads["ok"] += 1
        self.last_error = None
        log.info(
            "TLS certificate %s loaded (expires %s)",
            pair.cert,
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(pair.not_after)),
        )

    def _files_named(self, index: int) -> tuple[Path, Path]:
        return certificate_paths(self._settings.chain_files[index], self._policy_file)

    async def watch(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """Reload a certificate whenever its files change; runs until ``stop`` is set."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
            if stop.is_set():
                return
            for index in range(len(self._pairs)):
                await self._check(index)

    async def _check(self, index: int) -> None:
        signature = file_signature(self._files_named(index))
        if signature == self._seen[index]:
            return
        # A rotation writes the certificate and the key one after the other: read them once
        # neither has changed for a moment, not half-way.
        await asyncio.sleep(_SETTLE_S)
        if index >= len(self._pairs):
            return  # a policy reload named fewer certificates meanwhile
        settled = file_signature(self._files_named(index))
        if settled != signature:
            return
        # Refused or loaded, this version of the files is not read again.
        self._seen[index] = settled
        self._reload_one(index)


class TlsListeners:
    """A worker's TLS listeners as the metrics read them: the soonest expiry of any of their
    certificates, their reloads added up."""

    __slots__ = ("listeners",)

    def __init__(self, listeners: list[ListenerTls]) -> None:
        self.listeners = listeners

    @property
    def not_after(self) -> float:
        return min(listener.not_after for listener in self.listeners)

    @property
    def reloads(self) -> dict[str, int]:
        return {
            result: sum(listener.reloads[result] for listener in self.listeners)
            for result in ("ok", "failed")
        }
