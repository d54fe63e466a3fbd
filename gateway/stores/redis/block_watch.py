"""Which limits' keys an operator has blocked in Redis, so that only their calls read boxes.

A limit with a ``penalty:`` has its penalty boxes read in every call that decides it. A limit
without one has a box only when an operator blocks one of its keys (the keys' API): reading a
box in every call for that would cost Redis a ``GET`` per limit per request (4.5-5.5 µs of
Redis's time a call of three limits, +13-20%: bench/README.md), for blocks that are rare. So the
keys' API notes the limit in one hash beside the states (``{prefix}blocks``: a field per limit,
the hash kept until the latest block ends), and each replica reads that hash every
``POLL_S``: the calls of a limit named there read its boxes. The replica that blocks reads
its boxes at once; the others within ``POLL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from redis.asyncio import Redis

from gateway.log_throttle import LogThrottle
from gateway.redact import redact_text

log = logging.getLogger("gateway.store")

# How often a replica reads which limits have blocks (how late another replica's block is
# refused here, at most, plus a call's time).
POLL_S: Final = 1.0
# Names a replica noted itself stay noted this long, whatever a read that was already on
# its way answers.
_NOTED_FOR_S: Final = 2 * POLL_S
# Note a limit as blocked until at least ``ARGV[2]`` ms from now (the block's length).
NOTE_SCRIPT: Final = """
redis.call('HSET', KEYS[1], ARGV[1], '1')
local ttl = redis.call('PTTL', KEYS[1])
if ttl < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


def marker_key(key_prefix: str) -> str:
    """The hash naming the limits with blocks (no hash tag: a slot of its own)."""
    return f"{key_prefix}blocks"


class BlockWatch:
    """The names of the limits whose calls read their penalty boxes for operators' blocks."""

    def __init__(
        self, connect: Callable[[str], Redis], key_prefix: str, poll_s: float = POLL_S
    ) -> None:
        # ``connect(key)``: a new redis-py client of the server holding ``key``.
        self._connect = connect
        self.key = marker_key(key_prefix)
        self.poll_s = poll_s
        self.names: frozenset[str] = frozenset()
        self._noted: dict[str, float] = {}  # name -> loop time noted here
        self._client: Redis | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.reads = 0  # reads answered (tests)
        self._log = LogThrottle(log)

    def note(self, name: str) -> None:
        """This replica blocked a key of limit ``name``: its calls read the boxes from now."""
        self._noted[name] = _now()
        self.names = self.names | {name}

    def start(self) -> None:
        """Read now, then every ``poll_s`` until ``close``."""
        if self._closed or self._timer is not None or self._task is not None:
            return
        self._due()

    def _due(self) -> None:
        self._timer = None
        if self._closed:
            return
        self._task = asyncio.get_running_loop().create_task(self._read_and_repeat())

    async def _read_and_repeat(self) -> None:
        try:
            await self.read()
        finally:
            self._task = None
            if not self._closed:
                self._timer = asyncio.get_running_loop().call_later(self.poll_s, self._due)

    async def read(self) -> None:
        """Read the limits with blocks; on a failure keep the names as they are (logged)."""
        client = self._client
        if client is None:
            client = self._client = self._connect(self.key)
        try:
            fields = await client.hkeys(self.key)
        except Exception as exc:
            # A new client next time, of the server the slot map then names (a failover).
            self._client = None
            with contextlib.suppress(Exception):
                await client.aclose()
            self._log.log(
                logging.WARNING,
                "blocks",
                f"redis store: which limits have blocked keys was not read "
                f"({redact_text(str(exc)) or type(exc).__name__}); the last answer stands",
            )
            return
        now = _now()
        names = {_text(field) for field in fields}
        self._noted = {n: at for n, at in self._noted.items() if now - at < _NOTED_FOR_S}
        self.names = frozenset(names | self._noted.keys())
        self.reads += 1

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _text(field: bytes | str) -> str:
    return field.decode("utf-8", "surrogateescape") if isinstance(field, bytes) else field


def _now() -> float:
    return asyncio.get_running_loop().time()
