"""Clients: one script call per request, the calls of a loop iteration in one pipeline."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

log = logging.getLogger("gateway.store")

# Arguments this long are a limit's parameters (a letter and two or more doubles), never a
# time (16 digits): their RESP encoding is kept.
_CACHED_ARG_BYTES: Final = 17


class ScriptClient(Protocol):
    """What the store needs from a Redis client."""

    round_trips: int

    @property
    def topology(self) -> int:
        """A number that changes when the client reads a new cluster slot map (0 otherwise):
        the nodes keys were filed under may have changed."""
        ...

    def node_of(self, key: bytes) -> str:
        """The address of the node a call on ``key`` goes to (a cluster's master serving its
        slot, as this client's slot map says); ``""`` for a single server."""
        ...

    def submit(
        self, keys: Sequence[bytes], argv: Sequence[bytes], asking: str = ""
    ) -> asyncio.Future[Any]:
        """Queue one ``EVALSHA`` (to the node ``asking`` names, after ``ASKING``, when a slot
        being migrated redirected it). The future's result is the reply, or the error reply as
        an exception instance; the future fails if the whole batch does (timeout, connection)."""
        ...

    async def recover(self, error: Exception) -> str | None:
        """Repair what ``error`` says (script not loaded, slot moved or being migrated): the
        ``asking`` to submit again with ("" for none), or None when it is a failure."""
        ...

    async def prepare(self) -> None:
        """Connect, read the slot map (a cluster) and load the script on every master, so
        that no request's call has to (raises what fails)."""
        ...

    async def ping(self, node: str) -> None:
        """One ``PING`` to ``node`` (an address ``node_of`` gave; ``""`` the server or the seed)
        within the call timeout: an open circuit's probe (raises what fails)."""
        ...

    async def close(self) -> None: ...


class Batch:
    """Calls sent together as one pipeline, each with its own future (a caller that gives up
    cancels its own future, never its neighbours'). A call is one command, or ``ASKING`` and
    its command: ``sizes`` says how many replies each call takes, in order."""

    __slots__ = ("expected", "futures", "payloads", "replies", "sizes", "timer")

    def __init__(self) -> None:
        self.payloads: list[Any] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.sizes: list[int] = []
        self.expected = 0  # replies the whole batch takes
        self.replies: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None

    def add(
        self, payload: Any, loop: asyncio.AbstractEventLoop, size: int = 1
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = loop.create_future()
        self.payloads.append(payload)
        self.futures.append(future)
        self.sizes.append(size)
        self.expected += size
        return future

    def resolve(self, replies: Sequence[Any]) -> None:
        """Each call's reply, taken by position: its last reply, or the first error of its
        group (``ASKING`` refused)."""
        if self.timer is not None:
            self.timer.cancel()
        if len(replies) != self.expected:
            self.fail(RedisError(f"{len(replies)} replies for {self.expected} commands"))
            return
        start = 0
        for future, size in zip(self.futures, self.sizes, strict=True):
            group = replies[start : start + size]
            start += size
            if not future.done():
                errors = [reply for reply in group[:-1] if isinstance(reply, Exception)]
                future.set_result(errors[0] if errors else group[-1])

    def fail(self, error: BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for future in self.futures:
            if not future.done():
                future.set_exception(error)

    @property
    def settled(self) -> bool:
        return all(future.done() for future in self.futures)


def is_noscript(error: Exception) -> bool:
    """The program is not loaded where the call went: a script (NOSCRIPT), a function
    library (``Function not found``), or functions refused there (then the script is)."""
    if isinstance(error, NoScriptError):
        return True
    message = str(error)
    return (
        message.startswith("NOSCRIPT") or _function_missing(message) or _functions_refused(message)
    )


def _function_missing(message: str) -> bool:
    return "Function not found" in message


def _functions_refused(message: str) -> bool:
    """Redis before 7 (no FUNCTION, no FCALL), or a server or user that may not run them
    (a managed service's renamed commands, an ACL): the script is sent by EVALSHA instead."""
    lower = message.lower()
    if "fcall" not in lower and "function" not in lower:
        return False
    return "unknown command" in lower or "unknown subcommand" in lower or lower.startswith("noperm")


MAX_RECOVERIES: Final = 3


async def submit_recovering(
    client: ScriptClient, keys: Sequence[bytes], argv: Sequence[bytes]
) -> tuple[Any, int]:
    """One script call, sent again where Redis says where to: a new cluster client may meet
    MOVED, then NOSCRIPT on the right node; a slot being migrated answers ASK. A few rounds;
    anything else Redis refuses is raised. Returns the reply (or the error it still is) and
    how many times the call was sent again."""
    return await recovered(client, keys, argv, await client.submit(keys, argv))


async def recovered(
    client: ScriptClient, keys: Sequence[bytes], argv: Sequence[bytes], reply: Any
) -> tuple[Any, int]:
    """``submit_recovering`` from the call's first reply: a caller that awaited the call
    itself (no coroutine of its own on the request path) comes here for an error."""
    asking = ""
    recoveries = 0
    for _ in range(MAX_RECOVERIES):
        if not isinstance(reply, Exception):
            break
        target = await client.recover(reply)
        if target is None:
            raise reply
        # The script loaded, a call that was ASKed goes to the same node again.
        asking = target or (asking if is_noscript(reply) else "")
        recoveries += 1
        reply = await client.submit(keys, argv, asking=asking)
    return reply, recoveries


class PipelineClient:
    """redis-py (``redis.asyncio``, hiredis parser): each batch is one ``Pipeline`` (or
    ``ClusterPipeline``), at most ``max_in_flight`` outstanding per node. Kept to compare
    against.

    A cluster's calls are batched per node, as the thin client's: redis-py fails a whole
    cluster pipeline when it cannot connect to one of its nodes, after the other nodes have
    run their calls, and those callers would be told their charged calls failed."""

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
        self._filling: dict[str, Batch] = {}  # by node (node_of), "" for a single server
        self._in_flight: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loading: asyncio.Task[None] | None = None
        self._resetting: asyncio.Task[None] | None = None

    @property
    def topology(self) -> int:
        """redis-py replaces its slot map when it reads it again (moved slots it patches in
        place: not seen here)."""
        client = self.client
        return id(client.nodes_manager.slots_cache) if isinstance(client, RedisCluster) else 0

    def node_of(self, key: bytes) -> str:
        client = self.client
        if not isinstance(client, RedisCluster):
            return ""
        try:
            return str(client.nodes_manager.get_node_from_slot(key_slot(key)).name)
        except (RedisError, LookupError):  # no slot map yet: the call will find its node
            return ""

    def submit(
        self, keys: Sequence[bytes], argv: Sequence[bytes], asking: str = ""
    ) -> asyncio.Future[Any]:
        """``asking`` is never set: redis-py follows ASK itself."""
        loop = asyncio.get_running_loop()
        node = self.node_of(keys[0]) if keys else ""
        batch = self._filling.get(node)
        if batch is None:
            batch = self._filling[node] = Batch()
            if self._in_flight.get(node, 0) < self.max_in_flight:
                loop.call_soon(self._flush, node)
        return batch.add(("EVALSHA", self.sha, len(keys), *keys, *argv), loop)

    def _flush(self, node: str) -> None:
        batch = self._filling.get(node)
        in_flight = self._in_flight.get(node, 0)
        if batch is None or in_flight >= self.max_in_flight:
            return
        del self._filling[node]
        self._in_flight[node] = in_flight + 1
        task = asyncio.get_running_loop().create_task(self._run(node, batch))
        self._tasks.add(task)  # a task nobody references may be collected mid-flight
        task.add_done_callback(self._tasks.discard)

    async def _run(self, node: str, batch: Batch) -> None:
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
            if isinstance(exc, RedisConnectionError | TimeoutError):
                self._suspect()
        else:
            batch.resolve(results)
        finally:
            self._in_flight[node] -= 1
            if node in self._filling:
                self._flush(node)

    async def ping(self, node: str) -> None:
        client = self.client
        async with asyncio.timeout(self.timeout_s):
            if isinstance(client, RedisCluster) and node:
                target = client.get_node(node_name=node)
                if target is None:
                    raise RedisConnectionError(f"{node} is not in the slot map")
                # The node's own connections: not the cluster client's retry, which would
                # read the slot map again and drop the connections other nodes' calls use.
                await target.execute_command("PING")
            else:
                await client.ping()

    async def prepare(self) -> None:
        client = self.client
        if isinstance(client, RedisCluster):
            await client.initialize()
        await client.script_load(self.script)  # a cluster sends it to every primary

    def _suspect(self) -> None:
        """A node could not be reached: a cluster client reads the slot map again, so a
        promoted replica is found. Not by closing the client, as redis-py's own retry does:
        that would cut the connections of calls other nodes are running, whose charges the
        callers would be told failed."""
        client = self.client
        if isinstance(client, RedisCluster) and self._resetting is None:
            task = asyncio.get_running_loop().create_task(client.nodes_manager.initialize())
            self._resetting = task
            task.add_done_callback(self._reset)

    def _reset(self, task: asyncio.Task[None]) -> None:
        self._resetting = None
        if not task.cancelled():
            task.exception()  # a failed close changes nothing: the next failure tries again

    async def recover(self, error: Exception) -> str | None:
        if isinstance(error, RedisConnectionError | TimeoutError):
            self._suspect()  # a cluster pipeline reports a lost node per call
        if not is_noscript(error):
            return None  # the cluster client follows MOVED and ASK itself
        task = self._loading
        if task is None:
            task = self._loading = asyncio.get_running_loop().create_task(self._load())
        await asyncio.shield(task)
        return ""

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


_ASKING: Final = _command(b"ASKING")


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
            if len(batch.replies) == batch.expected:
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

    def submit(self, payload: bytes, size: int = 1) -> asyncio.Future[Any]:
        """Queue a call of ``size`` commands (their replies are its reply)."""
        loop = asyncio.get_running_loop()
        batch = self._filling
        if batch is None:
            batch = self._filling = Batch()
            # The deadline runs from the first call: it covers waiting, connecting and Redis.
            batch.timer = loop.call_at(loop.time() + self.client.timeout_s, self._expire, batch)
            loop.call_soon(self._flush)
        return batch.add(payload, loop, size)

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
            self.client.suspect(self)

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
                    self._in_flight += 1  # done() counts it back
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
            self.client.suspect(self)
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
    """A pipelined client on hiredis for exactly what the store sends: ``FCALL`` (or
    ``EVALSHA``) in batches, ``FUNCTION LOAD`` (or ``SCRIPT LOAD``), and for a cluster
    ``CLUSTER SLOTS`` and ``MOVED``. Per call it spends a fraction of redis-py's pipeline CPU
    (measured in bench/bench_store.py).

    Given a ``library`` (library.py), the program is a Redis function: loaded once per
    server, its algorithms defined once, where ``EVALSHA`` runs the whole script every call.
    A server that refuses functions (before Redis 7, a managed service, an ACL) gets the
    script by ``EVALSHA``, said once in the log."""

    def __init__(
        self,
        url: str,
        script: str,
        sha: str,
        max_in_flight: int,
        timeout_s: float,
        *,
        cluster: bool,
        library: str = "",
        function: str = "",
    ) -> None:
        parts = urlsplit(url)
        self.cluster = cluster
        self.script = script.encode()
        self.library = library.encode()
        self.functions = bool(library and function)
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.round_trips = 0
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "rediss":
            # ?ssl_ca_certs=FILE trusts a private CA, as the same URL does with redis-py.
            ca_file = parse_qs(parts.query).get("ssl_ca_certs")
            self.ssl = ssl.create_default_context(cafile=ca_file[-1] if ca_file else None)
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
        self._script_head = b"*%%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % sha.encode()
        self._head = self._script_head
        if self.functions:
            name = function.encode()
            self._head = b"*%%d\r\n$5\r\nFCALL\r\n$%d\r\n%s\r\n" % (len(name), name)
        self._encoded: dict[bytes, bytes] = {}
        self._nodes: dict[str, _Node] = {}
        self._seed = self._node(parts.hostname or "127.0.0.1", parts.port or 6379)
        # Slot -> node, from CLUSTER SLOTS; until known, calls go to the seed node, whose MOVED
        # replies fetch the map.
        self._slots: list[_Node | None] | None = None
        self._repairs: dict[str, asyncio.Task[None]] = {}
        self._topology = 0  # slot maps read

    def _node(self, host: str, port: int) -> _Node:
        address = f"{host}:{port}"
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = _Node(self, host, port)
        return node

    @property
    def topology(self) -> int:
        return self._topology

    def node_of(self, key: bytes) -> str:
        if not self.cluster:
            return ""
        slots = self._slots
        node = slots[key_slot(key)] if slots is not None else None
        return (node or self._seed).address

    def submit(
        self, keys: Sequence[bytes], argv: Sequence[bytes], asking: str = ""
    ) -> asyncio.Future[Any]:
        encoded = self._encoded
        # The key count's length is its own: ten keys or more (ten limits, five with penalty
        # boxes) take two digits.
        count = b"%d" % len(keys)
        parts = [self._head % (len(keys) + len(argv) + 3), b"$%d\r\n%s\r\n" % (len(count), count)]
        parts += [b"$%d\r\n%s\r\n" % (len(key), key) for key in keys]
        for arg in argv:
            bulk = encoded.get(arg)
            if bulk is None:
                bulk = b"$%d\r\n%s\r\n" % (len(arg), arg)
                if len(arg) >= _CACHED_ARG_BYTES:  # a limit's parameters: few, reused
                    encoded[arg] = bulk
            parts.append(bulk)
        payload = b"".join(parts)
        if asking:
            host, _, port = asking.rpartition(":")
            return self._node(host, int(port)).submit(_ASKING + payload, 2)
        if not self.cluster or self._slots is None:
            return self._seed.submit(payload)
        node = self._slots[key_slot(keys[0])]
        return (node or self._seed).submit(payload)

    async def recover(self, error: Exception) -> str | None:
        """NOSCRIPT or ``Function not found`` (a new server, a new master, a flush) loads the
        program; functions refused switches to the script; MOVED (a slot has a new owner:
        resharding, failover) reads the slot map again; ASK (a slot being migrated, this key
        already moved) sends the call once to the node it names. Anything else (CLUSTERDOWN,
        TRYAGAIN, LOADING, READONLY...) is a failure of this call."""
        message = str(error)
        if message.startswith("NOSCRIPT") or _function_missing(message):
            await self._once("script", self._load_script)
            return ""
        if _functions_refused(message):
            self.use_script(message)
            await self._once("script", self._load_script)
            return ""
        if not self.cluster:
            return None
        if message.startswith("MOVED "):
            await self._once("slots", self._refresh)
            return ""
        if message.startswith("ASK "):
            address = message.split()[-1]
            host, _, port = address.rpartition(":")
            if not port.isdigit():
                return None
            return f"{host or self._seed.host}:{port}"
        return None

    def suspect(self, node: _Node) -> None:
        """A node could not be reached: in a cluster, read the slot map again in the
        background (a failover may have promoted a replica), so the calls after the failed
        ones find the new owner."""
        if self.cluster and "slots" not in self._repairs:
            self._start("slots", self._refresh)

    async def refresh(self) -> None:
        """Read the slot map (a cluster): from the first node that answers."""
        await self._once("slots", self._refresh)

    async def ping(self, node: str) -> None:
        target = self._seed
        if node:
            host, _, port = node.rpartition(":")
            target = self._node(host, int(port))
        await target.execute(b"PING")

    async def prepare(self) -> None:
        if self.cluster:
            await self._once("slots", self._refresh)
        await self._once("script", self._load_script)  # connects every master

    async def _once(self, what: str, repair: Callable[[], Awaitable[None]]) -> None:
        """Run ``repair`` once for all the calls that need it now, within one timeout."""
        task = self._repairs.get(what) or self._start(what, repair)
        await asyncio.shield(task)

    def _start(self, what: str, repair: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        async def bounded() -> None:
            async with asyncio.timeout(self.timeout_s):
                await repair()

        task = self._repairs[what] = asyncio.get_running_loop().create_task(bounded())
        task.add_done_callback(lambda done: self._repaired(what, done))
        return task

    def _repaired(self, what: str, task: asyncio.Task[None]) -> None:
        self._repairs.pop(what, None)
        if not task.cancelled():
            task.exception()  # retrieved here; every caller that waits gets it raised

    async def _load_script(self) -> None:
        """The program on every master: the library (replacing one of the same name, which is
        the same code), or the script where functions are refused."""
        if self.cluster and self._slots is None:
            await self._refresh()
        nodes = self._masters() if self.cluster else [self._seed]
        if self.functions:
            library = self.library
            try:
                await asyncio.gather(
                    *[node.execute(b"FUNCTION", b"LOAD", b"REPLACE", library) for node in nodes]
                )
                return
            except ResponseError as exc:
                if not _functions_refused(str(exc)):
                    raise
                self.use_script(str(exc))
        await asyncio.gather(*[node.execute(b"SCRIPT", b"LOAD", self.script) for node in nodes])

    def use_script(self, reason: str) -> None:
        """Functions refused: every call from now on is an ``EVALSHA`` (said once)."""
        if not self.functions:
            return
        self.functions = False
        self._head = self._script_head
        log.warning(
            "Redis at %s refused functions (%s): the limits' script is sent by EVALSHA, "
            "which runs all of it on every call (Redis 7 functions run only the decision)",
            self._seed.address,
            reason.splitlines()[0][:200],
        )

    async def _refresh(self) -> None:
        errors = []
        # Nodes connected first: one that failed (killed, frozen) would spend the deadline.
        nodes = [self._seed, *(n for n in self._nodes.values() if n is not self._seed)]
        for node in sorted(nodes, key=lambda n: n.connection is None):
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
            self._topology += 1
            return
        raise RedisConnectionError("no cluster node gave its slot map: " + "; ".join(errors))

    def _masters(self) -> list[_Node]:
        if self._slots is None:
            return [self._seed]
        return list({id(node): node for node in self._slots if node is not None}.values())

    async def close(self) -> None:
        for node in self._nodes.values():
            node.close()
