"""What the container files run, run for real (no Docker engine here): the compose demo backend,
the image's environment-driven entrypoint, ``gateway healthcheck``, the SIGTERM drain delay, and
the Kubernetes manifests validated offline."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = aiohttp.ClientTimeout(total=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    proc: asyncio.subprocess.Process
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


Spawn = Callable[..., Awaitable[Process]]


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start a command (stdout and stderr to a file); killed at the end if still running."""
    started: list[Process] = []

    async def start(*cmd: str, env: dict[str, str] | None = None) -> Process:
        log_path = tmp_path / f"process-{len(started)}.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        started.append(Process(proc, log_path))
        return started[-1]

    yield start
    for running in started:
        if running.proc.returncode is None:
            running.proc.kill()
            await running.proc.wait()


async def wait_for_status(
    process: Process, url: str, status: int = 200, within_s: float = 20.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        while loop.time() < deadline:
            if process.proc.returncode is not None:
                raise AssertionError(f"exited early:\n{process.log()}")
            try:
                async with session.get(url) as resp:
                    if resp.status == status:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {within_s}s:\n{process.log()}")


def compose() -> dict[str, dict[str, dict[str, object]]]:
    data: dict[str, dict[str, dict[str, object]]] = yaml.safe_load(
        (ROOT / "docker-compose.yml").read_text()
    )
    return data


def on_loopback(args: list[str], port: int) -> list[str]:
    """A container command with its 0.0.0.0 listen addresses moved to loopback (tests use
    loopback only)."""
    return [a.replace("0.0.0.0:8000", f"127.0.0.1:{port}") for a in args]


async def test_compose_backend_serves_json_about_the_request_and_no_files(spawn: Spawn) -> None:
    backend = compose()["services"]["backend"]
    entrypoint = [str(a) for a in backend["entrypoint"]]  # type: ignore[attr-defined]
    command = [str(a) for a in backend["command"]]  # type: ignore[attr-defined]
    assert entrypoint[0] == "python"
    port = free_port()
    process = await spawn(sys.executable, *on_loopback(entrypoint[1:] + command, port))
    base = f"http://127.0.0.1:{port}"
    await wait_for_status(process, base + "/")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for path in ("/", "/etc/passwd", "/proc/self/environ", "/../../etc/passwd"):
            async with session.get(base + path) as resp:
                assert resp.content_type == "application/json", path
                body = await resp.text()
            assert "root:" not in body
            assert "PATH=" not in body
            assert "Directory listing" not in body
