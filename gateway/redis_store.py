"""Limit state in Redis, shared by every gateway replica: one atomic script call per request.

All limits of a request are decided by ONE call of one Lua script (``gateway/lua/``: a file per
algorithm mirroring its Python module, plus ``decide.lua`` which checks every limit, then commits
all or none). The script reads the clock from Redis ``TIME``, so replicas whose own clocks
disagree still share one timeline. Script calls of requests that arrive together go out as one
pipeline (each still its own atomic call), with at most ``max_in_flight`` pipelines outstanding.

Keys are ``{prefix}{{tag}}{limit}:{fingerprint}:{key}``. The fingerprint hashes the limit's
algorithm and key parts, so a reload that changes either starts the limit afresh. A key's value
is the parameters it was written under, then the state: a reload that changes only parameters
(rate, burst, limit, window) keeps the keys, and the script rescales a state written under
other parameters as the Python algorithm's ``rescale`` does, the first time it meets it, and
writes it back rescaled. So replicas that reload at different moments never read a state as if
written under their own parameters. Every key expires when its state has decayed to what an
absent key means, so idle keys vanish. The hash tag puts all keys one request touches in one
cluster slot: when every limit's key shares a part (say ``client_ip``), that part's value is
the tag and clients spread over the cluster; otherwise (a ``global`` limit stacked on
per-client ones, for instance) every key carries the same tag and lives on one node.

When Redis fails or is slow (``timeout_s`` per call), ``on_failure`` says what to do: ``local``
decides in an in-process ``MemoryStore`` with each limit divided by ``replicas``, ``allow``
admits, ``deny`` raises ``StoreUnavailableError`` (the engine answers 503). A circuit breaker
stops trying after a few failures in a row and probes again later. ``stats.state`` says what
answers: ``ok`` (Redis), ``fallback`` (a call failed, the circuit is still closed), ``open`` or
``half_open`` (the circuit's; ``on_failure`` answers meanwhile); each change is logged once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, Literal, Protocol, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.combine import CombinedDecision, combine, refuse_long_delays
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket, pack_state
from gateway.algorithms.sliding_log import SlidingLog, pack_log
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket, WarmingUpTokenBucket
from gateway.circuit import CircuitBreaker
from gateway.clock import Clock, MonotonicClock
from gateway.limits import Check, CompiledLimit
from gateway.observability.stats import StoreStats
from gateway.store import MemoryStore, StoreUnavailableError

log = logging.getLogger("gateway.redis_store")

FailureMode = Literal["local", "allow", "deny"]
FAILURE_MODES: Final = ("local", "allow", "deny")
_INF: Final = float("inf")
# Lua numbers are doubles: integers are exact below 2**53. Each codec checks the largest
# intermediate value its script can form (requests cost 1).
_EXACT_LIMIT: Final = 2**53
# An overridden clock (tests) has nothing to do with the clock Redis expires keys by.
_OVERRIDE_MIN_TTL_MS: Final = 600_000
_MAX_RECOVERIES: Final = 3
# Arguments this long are a limit's parameters (a letter and two or more doubles), never a
# time (16 digits): their RESP encoding is kept.
_CACHED_ARG_BYTES: Final = 17
_LUA_FILES: Final = (
    "prelude.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window.lua",
    "sliding_log.lua",
    "token_bucket.lua",
    "decide.lua",
)


def load_script() -> str:
    """The one script Redis runs: the prelude, every algorithm's mirror, then ``decide.lua``."""
    folder = resources.files("gateway") / "lua"
    return "\n".join((folder / name).read_text(encoding="utf-8") for name in _LUA_FILES)


# --- one codec per algorithm: its parameters for Lua, and its reply as a Decision -------------


def _exact(what: str, value: float) -> None:
    if not value < _EXACT_LIMIT:
        raise ValueError(
            f"{what} ({value:g}) is too large for the Redis store: its Lua arithmetic is exact "
            "only below 2**53"
        )


class Codec(Protocol):
    params: bytes
    nominal_limit: int

    def decision(self, allowed: int, a: int, b: int, c: int, d: int) -> Decision:
        """The Python algorithm's Decision from the script's four integers."""
        ...

    def decode_state(self, raw: bytes) -> Any:
        """The Python algorithm's state for a stored Redis value, written under this codec's
        parameters (tests, debugging)."""
        ...


def _state_of(raw: bytes, params: bytes) -> bytes:
    """The state in a stored value: the parameters it was written under come first."""
    if not raw.startswith(params):
        raise ValueError("the value was written under other parameters")
    return raw[len(params) :]


class LeakyBucketCodec:
    __slots__ = ("_limit", "nominal_limit", "params")

    def __init__(self, algorithm: LeakyBucket) -> None:
        burst_milli = algorithm.burst * 1000
        _exact("(burst + 2) * 10**6", (burst_milli + 2000) * 1000)
        delay_milli = _INF if algorithm.delay is None else algorithm.delay * 1000
        self.params = b"L" + struct.pack("<ddd", algorithm.rate_milli, burst_milli, delay_milli)
        self._limit = self.nominal_limit = algorithm.burst + 1

    def decision(
        self, allowed: int, delay_ms: int, retry_us: int, remaining: int, reset_us: int
    ) -> Decision:
        if allowed:
            return Decision(
                True,
                delay_ms / 1000,
                0.0,
                self._limit,
                remaining,
                reset_us / 1e6 if reset_us > 0 else 0.0,
            )
        if retry_us < 0:
            return Decision(False, 0.0, _INF, self._limit, 0, 0.0)
        return Decision(False, 0.0, retry_us / 1e6, self._limit, 0, reset_us / 1e6)

    def decode_state(self, raw: bytes) -> int:
        excess_milli, last_ms = struct.unpack("<dd", _state_of(raw, self.params))
        return pack_state(int(excess_milli), int(last_ms))


class _WindowCodec:
    """Fixed window, sliding window and sliding log reply alike."""

    __slots__ = ("_algorithm", "_limit", "nominal_limit", "params")

    def __init__(self, code: bytes, algorithm: FixedWindow | SlidingWindow | SlidingLog) -> None:
        _exact(
            "(2 * limit + 1) * window in microseconds",
            (2 * algorithm.limit + 1) * algorithm.window_us,
        )
        self._algorithm = algorithm
        self._limit = self.nominal_limit = algorithm.limit
        self.params = code + struct.pack("<dd", algorithm.limit, algorithm.window_us)

    def decision(
        self, allowed: int, _: int, retry_us: int, remaining: int, reset_us: int
    ) -> Decision:
        if allowed:
            return Decision(True, 0.0, 0.0, self._limit, remaining, reset_us / 1e6)
        retry_after_s = _INF if retry_us < 0 else retry_us / 1e6
        return Decision(False, 0.0, retry_after_s, self._limit, remaining, reset_us / 1e6)

    def decode_state(self, raw: bytes) -> Any:
        raw = _state_of(raw, self.params)
        algorithm = self._algorithm
        if isinstance(algorithm, SlidingLog):
            return pack_log([int(t) for t in struct.unpack(f"<{len(raw) // 8}d", raw)])
        if isinstance(algorithm, SlidingWindow):
            index, previous, current = struct.unpack("<ddd", raw)
            return algorithm.pack_state(int(index), int(previous), int(current))
        index, count = struct.unpack("<dd", raw)
        return algorithm.pack_state(int(index), int(count))


def _ticks(algorithm: TokenBucket | WarmingUpTokenBucket) -> tuple[int, int, float]:
    """``(ticks_per_us, interval_ticks, ticks_per_s)`` of a token bucket's exact tick clock."""
    rate = algorithm._rate
    _exact("ticks per second", rate.ticks_per_us * 1_000_000)
    return rate.ticks_per_us, rate.interval_ticks, rate.ticks_per_s


class TokenBucketCodec:
    __slots__ = ("_capacity", "_ticks_per_s", "_tpu", "nominal_limit", "params")

    def __init__(self, algorithm: TokenBucket) -> None:
        tpu, interval, ticks_per_s = _ticks(algorithm)
        max_credit = algorithm._max_credit_ticks
        _exact("4 * bucket capacity in ticks", 4 * max_credit)
        self._tpu = tpu
        self._ticks_per_s = ticks_per_s
        self._capacity = self.nominal_limit = algorithm.capacity
        self.params = b"T" + struct.pack(
            "<dddddd",
            tpu,
            interval,
            max_credit,
            1 if algorithm.mode == "queue" else 0,
            algorithm.capacity,
            algorithm._max_delay_ticks,
        )

    def decision(
        self, allowed: int, delay_ticks: int, retry_ticks: int, remaining: int, reset_ticks: int
    ) -> Decision:
        ticks_per_s = self._ticks_per_s
        if allowed:
            return Decision(
                True,
                delay_ticks / ticks_per_s if delay_ticks > 0 else 0.0,
                0.0,
                self._capacity,
                remaining,
                reset_ticks / ticks_per_s,
            )
        retry_after_s = _INF if retry_ticks < 0 else retry_ticks / ticks_per_s
        return Decision(
            False, 0.0, retry_after_s, self._capacity, remaining, reset_ticks / ticks_per_s
        )

    def decode_state(self, raw: bytes) -> int:
        whole_us, frac = struct.unpack("<dd", _state_of(raw, self.params))
        return int(whole_us) * self._tpu + int(frac)


class WarmingUpCodec:
    __slots__ = ("_credit_bits", "_ticks_per_s", "_tpu", "nominal_limit", "params")

    def __init__(self, algorithm: WarmingUpTokenBucket) -> None:
        tpu, interval, ticks_per_s = _ticks(algorithm)
        warmup_ticks = algorithm._warmup_ticks
        _exact("4 * warm-up in ticks", 4 * (warmup_ticks + interval))
        self._tpu = tpu
        self._ticks_per_s = ticks_per_s
        self._credit_bits = algorithm._credit_bits
        self.nominal_limit = 1
        self.params = b"W" + struct.pack(
            "<ddddddd",
            tpu,
            interval,
            warmup_ticks,
            algorithm._max_delay_ticks,
            algorithm.stable_interval_us,
            algorithm.threshold_permits,
            algorithm.slope,
        )

    def decision(
        self, allowed: int, delay_ticks: int, retry_ticks: int, remaining: int, reset_ticks: int
    ) -> Decision:
        ticks_per_s = self._ticks_per_s
        if allowed:
            return Decision(
                True,
                delay_ticks / ticks_per_s if delay_ticks > 0 else 0.0,
                0.0,
                1,
                remaining,
                reset_ticks / ticks_per_s,
            )
        return Decision(False, 0.0, retry_ticks / ticks_per_s, 1, 0, reset_ticks / ticks_per_s)

    def decode_state(self, raw: bytes) -> int:
        whole_us, frac, credit = struct.unpack("<ddd", _state_of(raw, self.params))
        return ((int(whole_us) * self._tpu + int(frac)) << self._credit_bits) | int(credit)


def codec_for(algorithm: Algorithm[Any]) -> Codec:
    """The Lua mirror's codec for an algorithm; ``ValueError`` if there is none or its
    parameters cannot be computed exactly in Lua (refused when the policy is loaded)."""
    if isinstance(algorithm, LeakyBucket):
        return LeakyBucketCodec(algorithm)
    if isinstance(algorithm, SlidingLog):
        return _WindowCodec(b"G", algorithm)
    if isinstance(algorithm, SlidingWindow):
        return _WindowCodec(b"S", algorithm)
    if isinstance(algorithm, FixedWindow):
        return _WindowCodec(b"F", algorithm)
    if isinstance(algorithm, WarmingUpTokenBucket):
        return WarmingUpCodec(algorithm)
    if isinstance(algorithm, TokenBucket):
        return TokenBucketCodec(algorithm)
    raise ValueError(f"the Redis store has no Lua mirror of {algorithm!r}")


def divided(algorithm: Algorithm[Any], replicas: int) -> Algorithm[Any]:
    """This replica's share of a limit when each replica enforces it alone (Redis is down):
    rates and capacities divided by ``replicas``, rounded down (never more lenient)."""
    if replicas == 1:
        return algorithm
    if isinstance(algorithm, LeakyBucket):
        burst = algorithm.burst // replicas
        delay = None if algorithm.delay is None else min(algorithm.delay // replicas, burst)
        if algorithm.period_s == 1 and algorithm.rate % replicas == 0:
            return LeakyBucket(algorithm.rate // replicas, 1, burst, delay)
        per_minute = algorithm.rate * (60 // algorithm.period_s)
        return LeakyBucket(max(per_minute // replicas, 1), 60, burst, delay)
    if isinstance(algorithm, SlidingLog | SlidingWindow | FixedWindow):
        return type(algorithm)(max(algorithm.limit // replicas, 1), algorithm.window_us / 1e6)
    if isinstance(algorithm, WarmingUpTokenBucket):
        return WarmingUpTokenBucket(
            algorithm.rate,
            algorithm.period_s * replicas,
            algorithm.warmup_s,
            mode=algorithm.mode,
            max_delay_s=algorithm.max_delay_s,
        )
    if isinstance(algorithm, TokenBucket):
        return TokenBucket(
            algorithm.rate,
            algorithm.period_s * replicas,
            max(algorithm.capacity // replicas, 1),
            mode=algorithm.mode,
            max_delay_s=algorithm.max_delay_s,
        )
    raise ValueError(f"cannot divide {algorithm!r} between replicas")


# --- keys ---------------------------------------------------------------------------------------

_WHOLE_KEY: Final = -1
_FIXED_TAG: Final = -2


def tag_scheme(limits: Sequence[CompiledLimit]) -> str | None:
    """The key part every limit's key has, whose value becomes the cluster hash tag; ``None``
    when there is none (then all keys share one fixed tag, hence one slot)."""
    if not limits:
        return None
    common = set(limits[0].spec.key)
    for limit in limits[1:]:
        common &= set(limit.spec.key)
    for part in limits[0].spec.key:
        if part in common:
            return part
    return None


@dataclass(frozen=True, slots=True)
class LimitPlan:
    """A limit ready for Redis: its codec, key layout and this replica's local share."""

    algorithm: Algorithm[Any]
    codec: Codec
    key_head: str  # "{prefix}" ... everything before the tag
    key_tail: str  # "}{limit}:{fingerprint}:"
    tag_index: int  # index of the tag part in the key, _WHOLE_KEY or _FIXED_TAG
    local: CompiledLimit

    def redis_key(self, key: str) -> str:
        index = self.tag_index
        if index == _WHOLE_KEY:
            tag = key
        elif index == _FIXED_TAG:
            tag = "*"
        else:
            parts = key.split("\x1f")
            tag = parts[index] if index < len(parts) else key
        if not tag or "}" in tag:
            tag = tag.replace("}", "%7D") or "~"  # an empty tag would hash the whole key
        return f"{self.key_head}{tag}{self.key_tail}{key}"


def _fingerprint(limit: CompiledLimit, codec: Codec) -> str:
    """The algorithm (the parameters' letter) and the key's parts, not the parameters: those
    are stored with each state, and a reload that changes them rescales the state."""
    digest = hashlib.blake2s(digest_size=4)
    digest.update(codec.params[:1])
    digest.update("\x1f".join((*limit.spec.key, limit.spec.on_missing_key)).encode())
    return digest.hexdigest()


# --- clients: one script call per request, the calls of a loop iteration in one pipeline ---------


class ScriptClient(Protocol):
    """What the store needs from a Redis client."""

    round_trips: int

    def submit(self, keys: Sequence[bytes], argv: Sequence[bytes]) -> asyncio.Future[Any]:
        """Queue one ``EVALSHA``. The future's result is the reply, or the error reply as an
        exception instance; the future fails if the whole batch does (timeout, connection)."""
        ...

    async def recover(self, error: Exception) -> bool:
        """Repair what ``error`` says (script not loaded, slot moved); True: submit again."""
        ...

    async def close(self) -> None: ...


class Batch:
    """Calls sent together as one pipeline, each with its own future (a caller that gives up
    cancels its own future, never its neighbours')."""

    __slots__ = ("futures", "payloads", "replies", "timer")

    def __init__(self) -> None:
        self.payloads: list[Any] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.replies: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None

    def add(self, payload: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = loop.create_future()
        self.payloads.append(payload)
        self.futures.append(future)
        return future

    def resolve(self, replies: Sequence[Any]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for future, reply in zip(self.futures, replies, strict=True):
            if not future.done():
                future.set_result(reply)

    def fail(self, error: BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for future in self.futures:
            if not future.done():
                future.set_exception(error)

    @property
    def settled(self) -> bool:
        return all(future.done() for future in self.futures)


def _is_noscript(error: Exception) -> bool:
    return isinstance(error, NoScriptError) or str(error).startswith("NOSCRIPT")


class PipelineClient:
    """redis-py (``redis.asyncio``, hiredis parser): each batch is one ``Pipeline`` (or
    ``ClusterPipeline``), at most ``max_in_flight`` outstanding. Kept to compare against."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        script: str,
        sha: str,
        max_in_flight: int,
        timeout_s: float,
    ) -> None:
        self.client = client
        self.script = script
        self.sha = sha.encode()
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.round_trips = 0
        self._filling: Batch | None = None
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loading: asyncio.Task[None] | None = None

    def submit(self, keys: Sequence[bytes], argv: Sequence[bytes]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        batch = self._filling
        if batch is None:
            batch = self._filling = Batch()
            if self._in_flight < self.max_in_flight:
                loop.call_soon(self._flush)
        return batch.add(("EVALSHA", self.sha, len(keys), *keys, *argv), loop)

    def _flush(self) -> None:
        batch = self._filling
        if batch is None or self._in_flight >= self.max_in_flight:
            return
        self._filling = None
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)  # a task nobody references may be collected mid-flight
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: Batch) -> None:
        self.round_trips += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                pipe = self.client.pipeline(transaction=False)
                for command in batch.payloads:
                    pipe.execute_command(*command)
                results: list[Any] = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # every caller gets the failure; none waits forever
            batch.fail(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            batch.resolve(results)
        finally:
            self._in_flight -= 1
            if self._filling is not None:
                self._flush()

    async def recover(self, error: Exception) -> bool:
        if not _is_noscript(error):
            return False  # the cluster client follows MOVED itself
        task = self._loading
        if task is None:
            task = self._loading = asyncio.get_running_loop().create_task(self._load())
        await asyncio.shield(task)
        return True

    async def _load(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.client.script_load(self.script)
        finally:
            self._loading = None

    async def close(self) -> None:
        await self.client.aclose()


def _command(*args: bytes) -> bytes:
    """A command in RESP, the protocol Redis speaks."""
    return b"*%d\r\n" % len(args) + b"".join([b"$%d\r\n%s\r\n" % (len(a), a) for a in args])


class _Connection(asyncio.Protocol):
    """One connection: batches written in order, replies (parsed by hiredis) matched in order."""

    def __init__(self, node: _Node) -> None:
        self.node = node
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.batches: deque[Batch] = deque()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def send(self, batch: Batch) -> None:
        assert self.transport is not None
        self.batches.append(batch)
        self.transport.write(b"".join(batch.payloads))

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        batches = self.batches
        while batches:
            reply = reader.gets()
            if reply is False:
                return
            batch = batches[0]
            batch.replies.append(reply)
            if len(batch.replies) == len(batch.payloads):
                batches.popleft()
                self.node.done(batch)
        if reader.gets() is not False:  # a reply nobody asked for: the stream is out of step
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        error = RedisConnectionError(f"connection to {self.node.address} lost: {exc or 'closed'}")
        while self.batches:
            self.batches.popleft().fail(error)
        self.node.lost(self)


class _Node:
    """One Redis server: one pipelined connection carrying at most ``max_in_flight`` batches;
    the calls submitted meanwhile fill the next batch."""

    def __init__(self, client: ThinClient, host: str, port: int) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.connection: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._filling: Batch | None = None
        self._in_flight = 0

    def submit(self, payload: bytes) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        batch = self._filling
        if batch is None:
            batch = self._filling = Batch()
            # The deadline runs from the first call: it covers waiting, connecting and Redis.
            batch.timer = loop.call_at(loop.time() + self.client.timeout_s, self._expire, batch)
            loop.call_soon(self._flush)
        return batch.add(payload, loop)

    async def execute(self, *args: bytes) -> Any:
        """One command off the hot path (SCRIPT LOAD, CLUSTER SLOTS); raises its error reply."""
        reply = await self.submit(_command(*args))
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _flush(self) -> None:
        batch = self._filling
        if batch is None or self._in_flight >= self.client.max_in_flight:
            return
        connection = self.connection
        if connection is None:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return
        self._filling = None
        if batch.settled:  # every caller gave up
            if batch.timer is not None:
                batch.timer.cancel()
            return
        self._in_flight += 1
        self.client.round_trips += 1
        connection.send(batch)

    def done(self, batch: Batch) -> None:
        self._in_flight -= 1
        batch.resolve(batch.replies)
        if self._filling is not None:
            self._flush()

    def _expire(self, batch: Batch) -> None:
        batch.fail(TimeoutError(f"no reply from Redis at {self.address} in time"))
        if batch is self._filling:
            self._filling = None  # never sent
        elif self.connection is not None and batch in self.connection.batches:
            # Sent: its replies may still come and would be matched to later calls.
            self.connection.abort()

    def lost(self, connection: _Connection) -> None:
        if self.connection is connection:
            self.connection = None
            self._in_flight = 0

    async def _connect(self) -> None:
        client = self.client
        try:
            async with asyncio.timeout(client.timeout_s):
                _, connection = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=client.ssl,
                    server_hostname=self.host if client.ssl is not None else None,
                )
                if client.handshake:
                    hello = Batch()
                    loop = asyncio.get_running_loop()
                    futures = [hello.add(command, loop) for command in client.handshake]
                    connection.send(hello)
                    for future in futures:
                        reply = await future
                        if isinstance(reply, Exception):
                            connection.abort()
                            raise reply
        except Exception as exc:
            self._connecting = None
            batch = self._filling
            if batch is not None:
                self._filling = None
                batch.fail(
                    RedisConnectionError(f"cannot connect to Redis at {self.address}: {exc}")
                )
            return
        self._connecting = None
        self.connection = connection
        self._flush()

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self.connection is not None:
            self.connection.abort()


class ThinClient:
    """A pipelined client on hiredis for exactly what the store sends: ``EVALSHA`` in batches,
    ``SCRIPT LOAD``, and for a cluster ``CLUSTER SLOTS`` and ``MOVED``. Per call it spends a
    fraction of redis-py's pipeline CPU (measured in bench/bench_store.py)."""

    def __init__(
        self,
        url: str,
        script: str,
        sha: str,
        max_in_flight: int,
        timeout_s: float,
        *,
        cluster: bool,
    ) -> None:
        parts = urlsplit(url)
        self.cluster = cluster
        self.script = script.encode()
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.round_trips = 0
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "rediss":
            self.ssl = ssl.create_default_context()
        elif parts.scheme != "redis":
            raise ValueError(f"the thin client speaks redis:// and rediss://, got {url!r}")
        self.handshake: list[bytes] = []
        if parts.password is not None:
            user = unquote(parts.username or "default").encode()
            self.handshake.append(_command(b"AUTH", user, unquote(parts.password).encode()))
        db = parts.path.strip("/")
        if db and db != "0":
            if cluster:
                raise ValueError(f"a Redis Cluster has only database 0, got {url!r}")
            self.handshake.append(_command(b"SELECT", db.encode()))
        self._head = b"*%%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % sha.encode()
        self._encoded: dict[bytes, bytes] = {}
        self._nodes: dict[str, _Node] = {}
        self._seed = self._node(parts.hostname or "127.0.0.1", parts.port or 6379)
        # Slot -> node, from CLUSTER SLOTS; until known, calls go to the seed node, whose MOVED
        # replies fetch the map.
        self._slots: list[_Node | None] | None = None
        self._repairs: dict[str, asyncio.Task[None]] = {}

    def _node(self, host: str, port: int) -> _Node:
        address = f"{host}:{port}"
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = _Node(self, host, port)
        return node

    def submit(self, keys: Sequence[bytes], argv: Sequence[bytes]) -> asyncio.Future[Any]:
        encoded = self._encoded
        parts = [self._head % (len(keys) + len(argv) + 3), b"$1\r\n%d\r\n" % len(keys)]
        parts += [b"$%d\r\n%s\r\n" % (len(key), key) for key in keys]
        for arg in argv:
            bulk = encoded.get(arg)
            if bulk is None:
                bulk = b"$%d\r\n%s\r\n" % (len(arg), arg)
                if len(arg) >= _CACHED_ARG_BYTES:  # a limit's parameters: few, reused
                    encoded[arg] = bulk
            parts.append(bulk)
        payload = b"".join(parts)
        if not self.cluster or self._slots is None:
            return self._seed.submit(payload)
        node = self._slots[key_slot(keys[0])]
        return (node or self._seed).submit(payload)

    async def recover(self, error: Exception) -> bool:
        message = str(error)
        if message.startswith("NOSCRIPT"):
            await self._once("script", self._load_script)
            return True
        if message.startswith("MOVED") and self.cluster:
            await self._once("slots", self._refresh)
            return True
        return False

    async def refresh(self) -> None:
        """Read the slot map (a cluster): from the first node that answers."""
        await self._once("slots", self._refresh)

    async def _once(self, what: str, repair: Callable[[], Awaitable[None]]) -> None:
        """Run ``repair`` once for all the calls that need it now, within one timeout."""
        task = self._repairs.get(what)
        if task is None:

            async def bounded() -> None:
                async with asyncio.timeout(self.timeout_s):
                    await repair()

            task = self._repairs[what] = asyncio.get_running_loop().create_task(bounded())
            task.add_done_callback(lambda done: self._repaired(what, done))
        await asyncio.shield(task)

    def _repaired(self, what: str, task: asyncio.Task[None]) -> None:
        self._repairs.pop(what, None)
        if not task.cancelled():
            task.exception()  # retrieved here; every caller that waits gets it raised

    async def _load_script(self) -> None:
        if self.cluster and self._slots is None:
            await self._refresh()
        nodes = self._masters() if self.cluster else [self._seed]
        await asyncio.gather(*[node.execute(b"SCRIPT", b"LOAD", self.script) for node in nodes])

    async def _refresh(self) -> None:
        errors = []
        for node in [self._seed, *(n for n in self._nodes.values() if n is not self._seed)]:
            try:
                ranges = await node.execute(b"CLUSTER", b"SLOTS")
            except Exception as exc:
                errors.append(f"{node.address}: {exc}")
                continue
            slots: list[_Node | None] = [None] * 16384
            for first, last, master, *_ in ranges:
                owner = self._node(master[0].decode() or node.host, int(master[1]))
                slots[first : last + 1] = [owner] * (last - first + 1)
            self._slots = slots
            return
        raise RedisConnectionError("no cluster node gave its slot map: " + "; ".join(errors))

    def _masters(self) -> list[_Node]:
        if self._slots is None:
            return [self._seed]
        return list({id(node): node for node in self._slots if node is not None}.values())

    async def close(self) -> None:
        for node in self._nodes.values():
            node.close()


# --- the store ----------------------------------------------------------------------------------


@dataclass(slots=True)
class RedisStoreCounters:
    """What the store did, beyond ``stats``; round trips per script call are
    ``store.round_trips / counters.calls``."""

    calls: int = 0  # script calls (one per request, one per dry-run limit, refunds)
    failed_calls: int = 0  # calls that timed out or failed
    local_decisions: int = 0  # decided in process (on_failure: local, or a refund)
    allowed_open: int = 0  # admitted without a decision (on_failure: allow)
    denied_closed: int = 0  # refused without a decision (on_failure: deny)
    recoveries: int = 0  # calls sent again after NOSCRIPT (a new Redis) or MOVED


def parse_store_url(url: str) -> tuple[str, bool]:
    """``(redis url, cluster?)`` for ``redis://``, ``rediss://``, ``redis+cluster://`` and
    ``rediss+cluster://``."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if sep and scheme in ("redis+cluster", "rediss+cluster"):
        return f"{scheme.partition('+')[0]}://{rest}", True
    if sep and scheme in ("redis", "rediss"):
        return url, False
    raise ValueError(
        f"invalid store url {url!r}: expected redis://, rediss://, redis+cluster:// or "
        "rediss+cluster://"
    )


ClientKind = Literal["thin", "redis-py"]


class RedisStore:
    """The ``LimitStore`` for several replicas: state in Redis or a Redis Cluster."""

    name = "redis"
    # The script refuses a delay over a check's bound before it commits anything.
    bounds_delays = True

    def __init__(
        self,
        url: str,
        *,
        on_failure: FailureMode = "local",
        replicas: int = 1,
        timeout_s: float = 0.05,
        key_prefix: str = "gw:",
        max_in_flight: int = 4,
        client: ClientKind = "thin",
        clock: Clock | None = None,
        time_source: Clock | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        """``clock`` drives the local fallback and the breaker; ``time_source`` (tests only)
        replaces Redis ``TIME`` as the scripts' clock."""
        if on_failure not in FAILURE_MODES:
            raise ValueError(f"on_failure must be local, allow or deny, got {on_failure!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout must be positive, got {timeout_s!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight!r}")
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must not contain braces (hash tags), got {key_prefix!r}")
        redis_url, cluster = parse_store_url(url)
        self.url = url
        self.cluster = cluster
        self.on_failure: FailureMode = on_failure
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.key_prefix = key_prefix
        self.time_source = time_source
        self.clock: Clock = clock or MonotonicClock()
        self.breaker = breaker or CircuitBreaker("redis store", clock=self.clock)
        self.breaker.on_transition = self._circuit_moved
        # For the metrics: calls, errors, call latency, and the circuit's state.
        self.stats = StoreStats()
        self.counters = RedisStoreCounters()
        self.local = MemoryStore(self.clock)
        self._min_ttl = b"%d" % _OVERRIDE_MIN_TTL_MS if time_source is not None else b"0"
        self.script = load_script()
        self.sha = hashlib.sha1(self.script.encode()).hexdigest()
        self.client: ScriptClient
        if client == "thin":
            self.client = ThinClient(
                redis_url, self.script, self.sha, max_in_flight, timeout_s, cluster=cluster
            )
        elif client == "redis-py":
            self.client = PipelineClient(
                _redis_py(redis_url, cluster, max_in_flight, timeout_s),
                self.script,
                self.sha,
                max_in_flight,
                timeout_s,
            )
        else:
            raise ValueError(f"client must be 'thin' or 'redis-py', got {client!r}")
        self._plans: dict[str, LimitPlan] = {}
        self._stale_plans: dict[tuple[str, Algorithm[Any]], LimitPlan] = {}
        self._tag_part: str | None = None

    @property
    def round_trips(self) -> int:
        """Pipelines sent to Redis; per script call, ``round_trips / counters.calls``."""
        return self.client.round_trips

    # -- configuration --

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        """New plans for a new policy (ValueError, before any change, if a limit cannot run in
        Redis); the local fallback keeps or rescales its state as the memory store does."""
        tag_part = tag_scheme(limits)
        plans = {limit.name: self._build_plan(limit, tag_part) for limit in limits}
        old_local = [self.plan(limit).local for limit in previous]
        self.local.configure([plan.local for plan in plans.values()], old_local)
        self._tag_part = tag_part
        self._plans = plans
        self._stale_plans.clear()

    def _build_plan(self, limit: CompiledLimit, tag_part: str | None) -> LimitPlan:
        codec = codec_for(limit.algorithm)
        parts = limit.spec.key
        if tag_part is None or tag_part not in parts:
            tag_index = _FIXED_TAG
        elif len(parts) == 1:
            tag_index = _WHOLE_KEY
        else:
            tag_index = parts.index(tag_part)
        return LimitPlan(
            algorithm=limit.algorithm,
            codec=codec,
            key_head=self.key_prefix + "{",
            key_tail=f"}}{limit.name}:{_fingerprint(limit, codec)}:",
            tag_index=tag_index,
            local=dataclasses.replace(limit, algorithm=divided(limit.algorithm, self.replicas)),
        )

    def plan(self, limit: CompiledLimit) -> LimitPlan:
        """The plan for a limit of the current policy, or of the one before (requests in
        flight across a reload)."""
        plan = self._plans.get(limit.name)
        if plan is not None and plan.algorithm is limit.algorithm:
            return plan
        stale_key = (limit.name, limit.algorithm)
        plan = self._stale_plans.get(stale_key)
        if plan is None:
            plan = self._stale_plans[stale_key] = self._build_plan(limit, self._tag_part)
        return plan

    def redis_key(self, check: Check) -> str:
        return self.plan(check.limit).redis_key(check.key)

    # -- the LimitStore protocol --

    async def decide(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        plans = [self.plan(check.limit) for check in checks]
        breaker = self.breaker
        if not breaker.allow():
            return await self._unavailable(checks, commit, "circuit open")
        probe = breaker.probe_out
        try:
            reply = await self._eval(b"d" if commit else b"p", checks, plans)
        except asyncio.CancelledError:  # the client hung up: a probe must not stay out
            breaker.cancelled(probe)
            raise
        except Exception as exc:
            self._failed(exc)
            return await self._unavailable(checks, commit, _describe(exc))
        self._answered()
        return _verdict(checks, plans, reply)

    async def decide_each(self, checks: Sequence[Check]) -> list[CombinedDecision]:
        """Dry-run limits, one script call each, all in flight together. They are never
        enforced, so when Redis fails they are decided locally whatever ``on_failure`` says."""
        plans = [self.plan(check.limit) for check in checks]
        breaker = self.breaker
        if not breaker.allow():
            return [await self._local_decide((check,), True) for check in checks]
        probe = breaker.probe_out
        calls = [
            self._eval(b"d", (check,), (plan,)) for check, plan in zip(checks, plans, strict=True)
        ]
        try:
            replies = await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:
            breaker.cancelled(probe)
            raise
        verdicts = []
        for check, plan, reply in zip(checks, plans, replies, strict=True):
            if isinstance(reply, BaseException):
                if isinstance(reply, asyncio.CancelledError):
                    breaker.cancelled(probe)
                    raise reply
                self._failed(reply)
                verdicts.append(await self._local_decide((check,), True))
            else:
                self._answered()
                verdicts.append(_verdict((check,), (plan,), reply))
        return verdicts

    async def refund(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """Best effort, never raises: a refund that cannot reach Redis is given locally.
        ``charged_us`` is the verdict's ``now_us`` (the Redis ``TIME`` the script decided at),
        with which windows give back exactly what that decision charged; without it they keep
        the charge. Buckets give it back either way."""
        if not checks:
            return
        plans = [self.plan(check.limit) for check in checks]
        breaker = self.breaker
        if breaker.allow():
            probe = breaker.probe_out
            charged = b"" if charged_us is None else b"%d" % charged_us
            try:
                await self._eval(b"r", checks, plans, charged)
            except asyncio.CancelledError:
                breaker.cancelled(probe)
                raise
            except Exception as exc:
                self._failed(exc)
            else:
                self._answered()
                return
        self.counters.local_decisions += 1
        # Without the instant: it may be Redis TIME, which the local clock's windows must not
        # take for one of theirs.
        await self.local.refund([self._local_check(check) for check in checks])

    def tracked_keys(self, limit_name: str) -> int:
        """Keys held in this process (the local fallback's); keys in Redis expire by TTL."""
        return self.local.tracked_keys(limit_name)

    async def close(self) -> None:
        await self.local.close()
        await self.client.close()

    # -- Redis --

    async def _eval(
        self,
        mode: bytes,
        checks: Sequence[Check],
        plans: Sequence[LimitPlan],
        charged_us: bytes = b"",
    ) -> list[int]:
        """One script call for all ``checks``; raises if Redis does not answer."""
        keys = [
            plan.redis_key(check.key).encode() for check, plan in zip(checks, plans, strict=True)
        ]
        time_source = self.time_source
        now = b"" if time_source is None else b"%d" % time_source.now_us()
        argv = [mode, now, b"1", self._min_ttl, *[plan.codec.params for plan in plans]]
        argv += [_bound(check.max_delay_s) for check in checks]
        if mode == b"r":
            argv.append(charged_us)
        self.counters.calls += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await self.client.submit(keys, argv)
        # A new cluster client may meet MOVED, then NOSCRIPT on the right node: a few rounds.
        for _ in range(_MAX_RECOVERIES):
            if not isinstance(reply, Exception):
                break
            if not await self.client.recover(reply):
                raise reply
            self.counters.recoveries += 1
            reply = await self.client.submit(keys, argv)
        if isinstance(reply, Exception):
            raise reply
        self.stats.observe(loop.time() - started)
        result: list[int] = reply
        return result

    def _answered(self) -> None:
        """Redis answered a call."""
        self.breaker.success()
        if self.stats.state != "ok":  # "fallback": the circuit was closed all along
            self.stats.set_state("ok", "Redis answered")

    def _failed(self, exc: BaseException) -> None:
        self.counters.failed_calls += 1
        self.stats.error()
        reason = _describe(exc)
        self.breaker.failure(reason)
        if self.breaker.state == "closed":  # below the threshold: on_failure answers this one
            self.stats.set_state("fallback", f"{reason} (on_failure: {self.on_failure})")

    def _circuit_moved(self, state: str) -> None:
        # The breaker has logged the transition: not again here. The metrics' names for its
        # states (a closed circuit means Redis answered).
        self.stats.state = "ok" if state == "closed" else state

    # -- when Redis cannot decide --

    def _local_check(self, check: Check) -> Check:
        return dataclasses.replace(check, limit=self.plan(check.limit).local)

    async def _local_decide(self, checks: Sequence[Check], commit: bool) -> CombinedDecision:
        self.counters.local_decisions += 1
        return await self.local.decide(
            [self._local_check(check) for check in checks], commit=commit
        )

    async def _unavailable(
        self, checks: Sequence[Check], commit: bool, reason: str
    ) -> CombinedDecision:
        mode = self.on_failure
        if mode == "local":
            return await self._local_decide(checks, commit)
        if mode == "allow":
            self.counters.allowed_open += 1
            decisions = tuple(
                Decision(True, 0.0, 0.0, limit, limit, 0.0)
                for limit in (self.plan(check.limit).codec.nominal_limit for check in checks)
            )
            return CombinedDecision(True, 0.0, 0.0, (), None, decisions, (None,) * len(checks))
        self.counters.denied_closed += 1
        retry_after_s = max(self.breaker.retry_in_s, self.timeout_s)
        raise StoreUnavailableError(f"rate-limit store unavailable: {reason}", retry_after_s)


def _redis_py(
    url: str, cluster: bool, max_in_flight: int, timeout_s: float
) -> Redis | RedisCluster:
    """A redis-py client with its timeouts and pool set for the hot path: redis-py 8's pool
    raises rather than waits once its connections are busy, and its defaults (5 s, retries)
    could hold a request for seconds."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # One retry reconnects a pooled connection a restarted Redis dropped; the batch
        # deadline bounds the whole attempt anyway.
        "retry": Retry(NoBackoff(), 1),
        "health_check_interval": 0,
        # One connection per pipeline in flight, and one for SCRIPT LOAD.
        "max_connections": max_in_flight + 1,
    }
    if cluster:
        return RedisCluster.from_url(url, **options)
    return Redis.from_url(url, **options)


def _bound(max_delay_s: float) -> bytes:
    """A delay bound for the script: shortest exact decimal, or '' for none."""
    return b"" if max_delay_s == _INF else repr(float(max_delay_s)).encode()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}"


def _verdict(
    checks: Sequence[Check], plans: Sequence[LimitPlan], reply: Sequence[int]
) -> CombinedDecision:
    """The verdict the script reached, as the memory store reaches it: combined, then a delay
    over its check's bound refused (the script did not commit it either)."""
    verdict = _combine([plan.codec for plan in plans], reply)
    if verdict.delay_s > 0.0:
        verdict = refuse_long_delays(
            verdict, verdict.states, [check.max_delay_s for check in checks]
        )
        if verdict.allowed:  # delayed: it may be refunded, exactly with the script's instant
            verdict = verdict._replace(now_us=reply[0])
    return verdict


def _combine(codecs: Sequence[Codec], reply: Sequence[int]) -> CombinedDecision:
    """The combined verdict from the script's reply, as ``decide_all`` builds it."""
    if len(codecs) == 1:
        decision = codecs[0].decision(reply[1], reply[2], reply[3], reply[4], reply[5])
        if decision.allowed:
            delayed = 0 if decision.delay_s > 0.0 else None
            return CombinedDecision(True, decision.delay_s, 0.0, (), delayed, (decision,), (None,))
        return CombinedDecision(
            False, 0.0, decision.retry_after_s, (0,), None, (decision,), (None,)
        )
    decisions = [
        codec.decision(*reply[base : base + 5])
        for codec, base in zip(codecs, range(1, 5 * len(codecs), 5), strict=True)
    ]
    states = (None,) * len(decisions)  # the script committed them: nothing to store here
    return combine(decisions, states, states)
