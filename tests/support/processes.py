"""Gateways as real processes (``python -m gateway ...`` on free loopback ports), for what only
a process has: signals, exit codes, ``--workers``, replicas on one store. Each process writes
its stdout and stderr to a log file; every one a test starts (and any worker it forked) is
killed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.network import free_port
from tests.support.waiting import wait_for_status, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class LoggedProcess:
    """A process a test started, its stdout and stderr going to ``log_path``."""

    proc: asyncio.subprocess.Process
    log_path: Path

    def log(self) -> str:
        """What it has written so far."""
        return self.log_path.read_text(errors="replace")


@dataclass
class GatewayProcess(LoggedProcess):
    """A gateway process and the loopback ports it was told to listen on."""

    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def children(pid: int) -> list[int]:
    """Live pids whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 3 is the state, 4 the parent pid; the command name in parentheses may
        # contain spaces.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def spawn(
    argv: list[str], log_path: Path, env: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``argv`` (after the interpreter) run from the repository's root, output to ``log_path``."""
    with log_path.open("wb") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            cwd=REPO_ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


async def kill(process: GatewayProcess) -> None:
    """SIGKILL the process and every worker it forked, if still running."""
    if process.proc.returncode is None:
        for child in children(process.proc.pid):
            os.kill(child, signal.SIGKILL)
        process.proc.kill()
    await process.proc.wait()


async def exit_code(process: GatewayProcess, within_s: float) -> int:
    """The process's exit status, once it exits (after a SIGTERM the test sent)."""
    try:
        return await asyncio.wait_for(process.proc.wait(), within_s)
    except TimeoutError:
        raise AssertionError(
            f"gateway still running {within_s}s after SIGTERM:\n{process.log()}"
        ) from None


async def until_ready(process: GatewayProcess, within_s: float = 20.0) -> None:
    """Until the process answers ``/readyz`` with 200."""
    await wait_for_status(process, process.admin_url + "/readyz", 200, within_s)


StartGateway = Callable[..., Awaitable[GatewayProcess]]


@pytest.fixture
async def gateway_process(tmp_path: Path) -> AsyncIterator[StartGateway]:
    """Start ``gateway run`` with extra ``args``, and a ``policy`` template (see
    ``policy_template``) or the listeners as options; ready (``/readyz``) unless told not."""
    started: list[GatewayProcess] = []

    async def start(
        *args: str,
        policy: str | None = None,
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
    ) -> GatewayProcess:
        port, admin_port = free_port(), free_port()
        argv = ["-m", "gateway", "run"]
        if policy is not None:
            policy_file = tmp_path / f"policy-{len(started)}.yaml"
            policy_file.write_text(policy.format(port=port, admin_port=admin_port))
            argv += ["--config", str(policy_file)]
        else:
            argv += ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"]
        log_path = tmp_path / f"gateway-{len(started)}.log"
        proc = await spawn([*argv, *args], log_path, env)
        running = GatewayProcess(proc, log_path, port, admin_port)
        started.append(running)
        if wait_ready:
            await until_ready(running)
        return running

    yield start
    for running in started:
        await kill(running)


@contextlib.asynccontextmanager
async def gateway_processes(
    argv_for: Callable[[int, int], list[str]], count: int, log_dir: Path
) -> AsyncIterator[list[GatewayProcess]]:
    """``count`` processes, each started with ``argv_for(port, admin_port)`` (after the
    interpreter) and ready (``/readyz``); at the end stopped with SIGTERM, then SIGKILL after
    15 s. Their logs stay readable after the block, for what they print when they stop."""
    started: list[GatewayProcess] = []
    launched = 0

    async def launch() -> GatewayProcess:
        nonlocal launched
        port, admin_port = free_port(), free_port()
        log_path = log_dir / f"process-{launched}.log"
        launched += 1
        proc = await spawn(argv_for(port, admin_port), log_path)
        return GatewayProcess(proc, log_path, port, admin_port)

    try:
        for _ in range(count):
            started.append(await launch())
        for index in range(count):
            for attempt in range(3):
                try:
                    # Starting is not what the tests measure: several interpreters importing
                    # the gateway on a busy 2-core machine have taken over 20 s, so the
                    # deadline only catches a hang.
                    await until_ready(started[index], within_s=90.0)
                    break
                except AssertionError:
                    process = started[index]
                    await kill(process)
                    if "address already in use" not in process.log() or attempt == 2:
                        raise
                    # Another program on the machine took the port first: other ports.
                    started[index] = await launch()
        yield started
    finally:
        for process in started:
            if process.proc.returncode is None:
                process.proc.send_signal(signal.SIGTERM)
        for process in started:
            try:
                await asyncio.wait_for(process.proc.wait(), 15)
            except TimeoutError:
                await kill(process)


Workers = tuple[str, str, Callable[[], list[int]]]


@contextlib.asynccontextmanager
async def run_workers(
    upstream_url: str,
    tmp_path: Path,
    extra: str = "",
    processes: int = 2,
    *,
    shared_dir: Path | None = None,
    server: str = "",
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Workers]:
    """``gateway run --workers N`` as a subprocess; yields proxy URL, admin URL, worker pids.

    ``extra``: policy text after the one route (a ``store:``, ``limits:``); ``server``: lines
    of the ``server:`` section after the listeners; ``env``: more environment. Snapshots go to
    ``tmp_path/metrics``, the shared limit state under ``shared_dir`` (``tmp_path/shared``);
    the output to ``tmp_path/gateway.log``.
    """
    port, admin_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n"
        "routes:\n  - name: all\n    upstream: backend\n" + extra
    )
    argv = ["-m", "gateway", "run", "--config", str(policy), "--workers", str(processes)]
    environ = {
        "GATEWAY_METRICS_DIR": str(tmp_path / "metrics"),
        "GATEWAY_SHARED_DIR": str(shared_dir or tmp_path / "shared"),
        **(env or {}),
    }
    log_path = tmp_path / "gateway.log"
    process = GatewayProcess(await spawn(argv, log_path, environ), log_path, port, admin_port)
    try:
        yield process.url, process.admin_url, lambda: children(process.proc.pid)
    finally:
        await kill(process)


def connections_to(pid: int, port: int) -> int:
    """Established TCP connections of process ``pid`` to a loopback ``port`` (read from
    /proc: the process's socket inodes, matched in /proc/net/tcp)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return 0
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
            count += 1
    return count


async def wait_serving(tmp_path: Path, processes: int, within_s: float = 60.0) -> None:
    """Until the log says each of ``processes`` workers is serving."""
    log = tmp_path / "gateway.log"

    def text() -> str:
        return log.read_text() if log.exists() else ""

    def serving() -> bool:
        return all(f"worker {i} serving" in text() for i in range(processes))

    await wait_until(serving, f"{processes} workers serving", within_s, 0.1, text)
