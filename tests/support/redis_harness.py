"""Real Redis for tests: ``redis-server`` processes on free loopback ports, and a real 3-master
Redis Cluster built with ``redis-cli --cluster create``; all torn down at the end.

Import the fixtures into a test module (``from tests.redis_harness import redis_server, ...``).
Session-scoped servers are shared: tests keep apart by giving each store its own key prefix.
Tests that stop, pause or restart Redis start their own with ``redis_factory``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.network import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT_S = 10.0


def key_prefixes() -> Iterator[str]:
    """Ids for key prefixes, unique in the session's shared servers. A module counter is not:
    pytest imports a test module as ``test_redis_store`` and its importers import it again as
    ``tests.test_redis_store``, two counters from 0; a store then met the keys another left
    (kept 10 minutes under a test clock, up to two 30-day windows for large quotas)."""
    run = uuid.uuid4().hex[:8]
    n = 0
    while True:
        yield f"{run}.{n}"
        n += 1


def _ping(port: int, timeout_s: float = 0.5) -> bool:
    """True once the server answers (a password-protected one answers NOAUTH)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _cli(port: int, *args: str, timeout_s: float = 10.0) -> str:
    done = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)} failed: {done.stderr or done.stdout}")
    return done.stdout


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; no persistence; can be stopped, paused, restarted."""

    def __init__(
        self, work_dir: Path, *, cluster: bool = False, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.work_dir = work_dir
        self.cluster = cluster
        self.extra_args = extra_args
        self.port = 0
        self.bus_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = work_dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        argv = [
            REDIS_SERVER,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.work_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        argv += self.extra_args
        if self.cluster:
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.work_dir / "nodes.conf"),
                "--cluster-node-timeout",
                "3000",
                "--cluster-port",
                str(self.bus_port),
            ]
        return argv

    def start(self, *, same_port: bool = False) -> None:
        """Start on fresh free ports (retried if another process takes one first), or on the
        ports used before (``same_port``: a restart clients must find again)."""
        attempts = 1 if same_port else 3
        for _ in range(attempts):
            if not same_port:
                self.port = free_port()
                self.bus_port = free_port() if self.cluster else 0
            self.process = subprocess.Popen(
                self._argv(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if _ping(self.port):
                    return
                time.sleep(0.02)
            self._reap()
        raise RuntimeError(
            f"redis-server did not start on 127.0.0.1:{self.port}: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text().splitlines()[-5:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server at once (SIGKILL: a crash, nothing flushed)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self._reap()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start(same_port=True)

    def _reap(self) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None


class RedisClusterHarness:
    """A real Redis Cluster: three masters (and ``replicas`` replicas of each), all 16384 slots
    covered. Slots can be migrated and masters failed over or killed while clients run."""

    def __init__(
        self,
        work_dir: Path,
        masters: int = 3,
        replicas: int = 0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``extra_args`` go to every node's redis-server (``--cluster-require-full-coverage
        no``, ...)."""
        self.replicas = replicas
        self.nodes = []
        for index in range(masters * (1 + replicas)):
            node_dir = work_dir / f"node{index}"
            node_dir.mkdir()
            self.nodes.append(RedisServer(node_dir, cluster=True, extra_args=extra_args))

    @property
    def url(self) -> str:
        """The store URL: one node; the client discovers the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        _cli(
            self.nodes[0].port,
            "--cluster",
            "create",
            *[f"127.0.0.1:{node.port}" for node in self.nodes],
            "--cluster-replicas",
            str(self.replicas),
            "--cluster-yes",
            timeout_s=60,
        )
        self.wait_ok()

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and agrees on the slot owners."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = self.live()
            if all("cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO") for n in nodes):
                maps = {str(self._slot_map(n.port)) for n in nodes}
                if len(maps) == 1:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster did not settle within {timeout_s:g} s")

    def _slot_map(self, port: int) -> list[tuple[int, int, int]]:
        with redis.Redis(host="127.0.0.1", port=port) as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in ranges)

    def node_at(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def owner(self, slot: int) -> RedisServer:
        """The master serving ``slot`` (as a live node sees it)."""
        for first, last, port in self._slot_map(self.live()[0].port):
            if first <= slot <= last:
                return self.node_at(port)
        raise LookupError(f"slot {slot} is not covered")

    def wait_owner(self, slot: int, node: RedisServer, timeout_s: float = 20.0) -> None:
        """Until every live node sees ``node`` serving ``slot`` (a failover took effect)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.owner(slot) is node:
                    self.wait_ok()
                    if self.owner(slot) is node:
                        return
            except (redis.RedisError, RuntimeError, LookupError):
                pass
            time.sleep(0.1)
        nodes = _cli(self.live()[0].port, "CLUSTER", "NODES")
        raise RuntimeError(
            f"127.0.0.1:{node.port} did not take slot {slot} in {timeout_s:g} s: {nodes}"
        )

    def promote(self, slot: int, replica: RedisServer) -> None:
        """``CLUSTER FAILOVER`` on ``replica`` of the master serving ``slot``, once it is in
        sync, until it serves the slot. Redis drops a manual failover that does not finish in
        5 s (the replica catching up, the election), which a busy machine can take: asked
        again then, up to three times."""
        self.wait_synced(replica)
        for attempt in range(3):
            with contextlib.suppress(RuntimeError):  # a late success: it is a master already
                _cli(replica.port, "CLUSTER", "FAILOVER")
            try:
                self.wait_owner(slot, replica, timeout_s=10.0)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def wait_synced(self, replica: RedisServer, timeout_s: float = 20.0) -> None:
        """Until ``replica`` has synced with its master (``master_link_status:up``)."""
        deadline = time.monotonic() + timeout_s
        while "master_link_status:up" not in _cli(replica.port, "INFO", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"127.0.0.1:{replica.port} did not sync with its master")
            time.sleep(0.1)

    def replica_of(self, master: RedisServer) -> RedisServer:
        master_id = _cli(master.port, "CLUSTER", "MYID").strip()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a demoted master takes a moment to attach
            for line in _cli(master.port, "CLUSTER", "REPLICAS", master_id).splitlines():
                fields = line.split()  # <id> <ip:port@cport> <flags> ...
                if len(fields) > 2 and "fail" not in fields[2]:
                    return self.node_at(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
            time.sleep(0.1)
        raise LookupError(f"no replica of 127.0.0.1:{master.port}")

    def begin_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """``CLUSTER SETSLOT`` IMPORTING/MIGRATING: the slot's existing keys stay on ``source``
        (new ones are ASKed to ``target``) until ``move_keys``."""
        target_id = _cli(target.port, "CLUSTER", "MYID").strip()
        source_id = _cli(source.port, "CLUSTER", "MYID").strip()
        _cli(target.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        _cli(source.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """MIGRATE every key of ``slot`` from ``source`` to ``target`` (ASK from now on)."""
        moved = 0
        with redis.Redis(host="127.0.0.1", port=source.port) as client:
            while keys := client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
                )
                moved += len(keys)
        return moved

    def end_migration(self, slot: int, target: RedisServer) -> None:
        """``CLUSTER SETSLOT NODE`` on every master: the slot is the target's (MOVED)."""
        target_id = _cli(target.port, "CLUSTER", "MYID").strip()
        _cli(target.port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        for node in self.live():
            if node is not target and "role:master" in _cli(node.port, "INFO", "replication"):
                _cli(node.port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        self.wait_ok()

    def keys_per_node(self, pattern: str = "*") -> list[int]:
        """How many keys matching ``pattern`` each master holds."""
        counts = []
        for node in self.nodes:
            with redis.Redis(host="127.0.0.1", port=node.port) as client:
                counts.append(sum(1 for _ in client.scan_iter(match=pattern, count=1000)))
        return counts

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class RedisFactory:
    """Starts private servers for tests that stop or pause them; stops them all at the end."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[RedisServer] = []

    def start(self, *extra_args: str) -> RedisServer:
        """A new server; ``extra_args`` go to redis-server (``--requirepass``, ...)."""
        server = RedisServer(
            Path(tempfile.mkdtemp(prefix="redis-", dir=self.base)), extra_args=extra_args
        )
        server.start()
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHarness]:
    cluster = RedisClusterHarness(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[RedisFactory]:
    factory = RedisFactory(tmp_path)
    yield factory
    factory.stop_all()
