"""A JSON Web Key Set fetched from its URL: at start, and again when a token names a ``kid``
the set lacks (a key rotated in), at most once per ``min_refresh_s``; a fetch that fails keeps
the last good set, and says so in the log once per cause and interval."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import aiohttp

from gateway.log_throttle import LogThrottle
from gateway.policy.jwt_keys import Key, key_set_of
from gateway.redact import redact_url

log = logging.getLogger("gateway.jwt")

# The longest one fetch may take; a request waits at most ``jwt.jwks_timeout`` for it.
FETCH_TIMEOUT_S = 10.0


class JwksKeys:
    """The key set of one URL, by ``kid``; ``removed`` counts the fetches that dropped a key
    (a verifier forgets the tokens it verified when it changes)."""

    def __init__(
        self,
        url: str,
        min_refresh_s: float,
        *,
        keys: dict[str, Key] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        throttle: LogThrottle | None = None,
        on_removed: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        self.min_refresh_s = min_refresh_s
        self.keys: dict[str, Key] = dict(keys or {})
        self.removed = 0
        self._on_removed = on_removed
        self.fetches = 0
        self._monotonic = monotonic
        self._last_attempt = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._throttle = throttle or LogThrottle(log, 10.0)

    def refresh(self) -> asyncio.Future[None] | None:
        """The fetch in flight, a new one if none was tried within ``min_refresh_s``, or
        ``None`` (too soon, or no event loop to fetch on)."""
        task = self._task
        if task is not None and not task.done():
            return task
        now = self._monotonic()
        if now - self._last_attempt < self.min_refresh_s:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        self._last_attempt = now
        self._task = loop.create_task(self._fetch())
        return self._task

    async def _fetch(self) -> None:
        self.fetches += 1
        try:
            timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(self.url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                document = await response.json(content_type=None)
            keys = key_set_of(document)
            if not keys:
                raise ValueError("the set holds no usable signing key with a kid")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            cause = type(exc).__name__
            if self._throttle.due(("jwks", cause)):
                self._throttle.log(
                    logging.WARNING,
                    ("jwks", cause),
                    f"jwt: fetching {redact_url(self.url)} failed ({cause}: {exc}); "
                    f"{len(self.keys)} keys of the last good set kept",
                )
            return
        removed = bool(self.keys.keys() - keys.keys())
        self.keys = keys
        if removed:
            self.removed += 1
            if self._on_removed is not None:
                self._on_removed()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
