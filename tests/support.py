"""What several test files share (fixtures stay in conftest.py): policies, scrapes of
``/metrics``, a ``--workers 2`` gateway as a subprocess, several gateway processes started
together, bursts of concurrent decisions, and a few constants."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from gateway.limits.compiled import Check
    from gateway.stores import RedisStore

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = aiohttp.ClientTimeout(total=10)
# An epoch-sized start, like Redis TIME: the Lua arithmetic must stay exact at this magnitude.
T0_US = 1_763_000_000_000_000

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def policy_for(upstream_url: str, extra: str = "", server: str = "") -> str:
    """A policy text with one upstream ``backend`` and a catch-all route."""
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n    connect_timeout: 2s\n"
        "    read_timeout: 5s\n"
        "routes:\n  - name: all\n    upstream: backend\n" + extra
    )


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def scrape(session: aiohttp.ClientSession, admin_url: str) -> tuple[Samples, str]:
    async with session.get(admin_url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return parse_metrics(text), text


async def get_status(session: aiohttp.ClientSession, url: str, **kwargs: object) -> int:
    async with session.get(url, **kwargs) as resp:  # type: ignore[arg-type]
        await resp.read()
        return resp.status


def _below_ephemeral_ports() -> range:
    """Ports the kernel never hands out as the local end of an outgoing connection."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10_000, max(low, 11_000))


_PORT_PICKER = random.Random()  # its own: pytest-randomly reseeds `random` for every test
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process started next to listen on. Taken below the
    ephemeral range: a port that ``bind(0)`` picks is also one an outgoing connection (another
    gateway's to Redis or to an upstream) may take as its local end in the second or two
    before the process binds it, which then fails to start with "address in use". Never the
    same port twice in one test run, so processes started together cannot be given one port,
    and one a test's process may still bind late is not handed to the next test."""
    ports = _below_ephemeral_ports()
    if len(_HANDED_OUT) > len(ports) // 2:
        _HANDED_OUT.clear()
    for _ in range(200):
        port = _PORT_PICKER.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted at ``path`` for the block: a full disk
    made for real. Needs root and a kernel that lets this process mount (CI runs as root);
    the test is skipped, saying so, where it cannot."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        reason = mounted.stderr.strip() or f"exit {mounted.returncode}"
        pytest.skip(f"cannot mount a tmpfs here ({reason}): full-disk cases need root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill_to(directory: Path, leave_bytes: int) -> Path:
    """Allocate a file in ``directory`` so that ``leave_bytes`` stay free; the file."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    with filler.open("wb") as out:
        os.posix_fallocate(out.fileno(), 0, stat.f_bavail * stat.f_frsize - leave_bytes)
    return filler


def limited_policy(upstream_url: str, limits: str, server: str = "") -> str:
    return policy_for(upstream_url, server=server) + "limits:\n" + limits


PER_IP_BURST_4 = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 4\n    nodelay: true\n"
)


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once (a rename), so a watcher never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def scrape_until(
    session: aiohttp.ClientSession,
    admin_url: str,
    condition: Callable[[Samples], bool],
    within_s: float = 10.0,
) -> Samples:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    samples: Samples = {}
    while loop.time() < deadline:
        try:
            samples, _ = await scrape(session, admin_url)
        except (aiohttp.ClientError, AssertionError):
            samples = {}
        if samples and condition(samples):
            return samples
        await asyncio.sleep(0.2)
    raise AssertionError(f"no scrape met the condition within {within_s}s: {samples}")


Workers = tuple[str, str, Callable[[], list[int]]]


@contextlib.asynccontextmanager
async def run_workers(
    upstream_url: str,
    tmp_path: Path,
    extra: str = "",
    processes: int = 2,
    shared_dir: Path | None = None,
    server: str = "",
    env: dict[str, str] | None = None,
) -> AsyncIterator[Workers]:
    """``gateway run --workers N`` as a subprocess; yields proxy URL, admin URL, worker pids.

    ``extra``: policy text after the one route (a ``store:``, ``limits:``); ``server``: lines
    of the ``server:`` section after the listeners; ``env``: more environment. Snapshots go to
    ``tmp_path/metrics``, the shared limit state under ``shared_dir`` (``tmp_path/shared``).
    """
    port, admin_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n"
        "routes:\n  - name: all\n    upstream: backend\n" + extra
    )
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "run", "--config", str(policy),
            "--workers", str(processes),
            cwd=REPO_ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={
                **os.environ,
                "GATEWAY_METRICS_DIR": str(tmp_path / "metrics"),
                "GATEWAY_SHARED_DIR": str(shared_dir or tmp_path / "shared"),
                **(env or {}),
            },
        )  # fmt: skip

    def workers() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[1]) == proc.pid and fields[0] != "Z":
                    pids.append(int(entry))
        return pids

    try:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", workers
    finally:
        for pid in workers():
            os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@dataclasses.dataclass
class GatewayProcess:
    """One gateway process of ``gateway_processes``; ``output`` (stdout and stderr) once it
    has stopped."""

    popen: subprocess.Popen[str]
    port: int
    admin_port: int
    output: str = ""


def _ready(process: GatewayProcess) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{process.admin_port}/readyz", timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def gateway_processes(
    argv_for: Callable[[int, int], list[str]], count: int
) -> Iterator[list[GatewayProcess]]:
    """``count`` gateway processes, each started with ``argv_for(port, admin_port)`` (after
    the interpreter) and ready (``/readyz``); at the end stopped with SIGTERM, then SIGKILL
    after 15 s, their output kept."""
    started: list[GatewayProcess] = []

    def launch() -> GatewayProcess:
        port, admin_port = free_port(), free_port()
        popen = subprocess.Popen(
            [sys.executable, *argv_for(port, admin_port)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return GatewayProcess(popen, port, admin_port)

    try:
        started.extend(launch() for _ in range(count))
        # Starting is not what the tests measure: several interpreters importing the gateway
        # on a busy 2-core machine have taken over 20 s, so the deadline only catches a hang.
        deadline = time.monotonic() + 90
        for index in range(count):
            attempts = 1
            while not _ready(started[index]):
                process = started[index]
                if process.popen.poll() is not None or time.monotonic() > deadline:
                    process.popen.kill()
                    output, _ = process.popen.communicate(timeout=15)
                    if "address already in use" in output and attempts < 3:
                        # Another program on the machine took the port first: other ports.
                        started[index] = launch()
                        attempts += 1
                        continue
                    raise RuntimeError(
                        f"a gateway did not start on port {process.port}"
                        f" (exit {process.popen.returncode}): {output[-2000:]}"
                    )
                time.sleep(0.05)
        yield started
    finally:
        for process in started:
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.output, _ = process.popen.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.output, _ = process.popen.communicate(timeout=5)


async def burst(store: RedisStore, check: Check, requests: int, clients: int = 8) -> int:
    """``requests`` decisions from ``clients`` concurrent clients; how many were admitted."""
    admitted = 0

    async def client(count: int) -> None:
        nonlocal admitted
        for _ in range(count):
            verdict = await store.decide([check])  # awaited before `admitted` is read
            admitted += verdict.allowed

    shares = [requests // clients + (i < requests % clients) for i in range(clients)]
    async with asyncio.timeout(20):
        await asyncio.gather(*(client(share) for share in shares))
    return admitted
