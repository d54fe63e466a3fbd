"""An admin listener off loopback needs a token: without one (and without
``server.admin_insecure: true``) ``run`` refuses to start, ``check`` says the same and a
reload that would drop the token is refused. Real gateway processes; a listener off loopback
is started only inside a network namespace of the test's own (tests/support/netns.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gateway.admin.auth import is_loopback
from gateway.cli.supervisor import EXIT_STARTUP
from tests.support import netns
from tests.support.network import free_port
from tests.support.processes import REPO_ROOT
from tests.support.processes import LoggedProcess as Process
from tests.support.waiting import wait_until

TOKEN = "exposure-test-token-0123456789"
# Nothing from the environment the tests run in: each test says what it sets.
BARE = {
    "GATEWAY_ADMIN_TOKEN": "",
    "GATEWAY_ADMIN_TOKEN_FILE": "",
    "GATEWAY_ADMIN_TOKEN_AUTO_FILE": "",
    "GATEWAY_LISTEN": "",
    "GATEWAY_ADMIN_LISTEN": "",
    "GATEWAY_IN_CONTAINER": "",
}
REFUSAL = (
    "is off loopback and has no admin token: anyone who reaches it could read the policy and "
    "reload it; give it a token (GATEWAY_ADMIN_TOKEN, GATEWAY_ADMIN_TOKEN_FILE or "
    "server.admin_token_file; `gateway admin-token FILE` writes one), or listen on 127.0.0.1, "
    "or write server.admin_insecure: true to serve it open"
)


def policy(admin_listen: str, extra: str = "", listen: str = "127.0.0.1:8080") -> str:
    return (
        f"server:\n  listen: {listen}\n  admin_listen: {admin_listen}\n{extra}"
        "upstreams:\n  demo:\n    url: builtin:demo\nroutes:\n  - name: all\n    upstream: demo\n"
    )


def gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **BARE, **(env or {})},
    )


def test_loopback_is_127_8_the_ipv6_one_and_localhost_never_a_wildcard() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.77.0.1", "192.168.1.5", "fe80::1", "gateway.local"):
        assert not is_loopback(host), host


def test_run_and_check_refuse_a_wildcard_admin_listener_without_a_token(tmp_path: Path) -> None:
    """Refused before anything listens: the wildcard is never served."""
    file = tmp_path / "open.yaml"
    file.write_text(policy(f"0.0.0.0:{free_port()}"))
    admin = file.read_text().splitlines()[2].split()[1]
    run = gateway("run", "--config", str(file))
    assert run.returncode == EXIT_STARTUP
    assert run.stdout + run.stderr == (
        f"gateway: {file}: the admin listener on {admin} (server.admin_listen) {REFUSAL}\n"
    )
    check = gateway("check", str(file))
    assert (check.returncode, check.stdout) == (1, "")
    assert check.stderr == (
        f"{file}:3: server.admin_listen: the admin listener on {admin} (server.admin_listen) "
        f"{REFUSAL}\n"
    )

    # The environment's address and the command line's are refused alike, IPv6's wildcard too.
    loopback = tmp_path / "loopback.yaml"
    loopback.write_text(policy("127.0.0.1:9090"))
    port = free_port()
    env = {"GATEWAY_ADMIN_LISTEN": f"0.0.0.0:{port}"}
    run = gateway("run", "--config", str(loopback), env=env)
    assert run.returncode == EXIT_STARTUP
    assert f"on 0.0.0.0:{port} (GATEWAY_ADMIN_LISTEN) {REFUSAL}" in run.stderr
    check = gateway("check", str(loopback), env=env)
    assert check.returncode == 1 and f"(GATEWAY_ADMIN_LISTEN) {REFUSAL}" in check.stderr
    run = gateway("run", "--config", str(loopback), "--admin-listen", f"[::]:{port}")
    assert run.returncode == EXIT_STARTUP
    assert run.stderr.count("\n") == 1
    assert f"on [::]:{port} (the command line) {REFUSAL}" in run.stderr
    # --workers N: said once, by the supervisor.
    run = gateway("run", "--config", str(file), "--workers", "2")
    assert run.returncode == EXIT_STARTUP
    assert run.stderr.count(REFUSAL) == 1, run.stderr

    # What check accepts: a token, loopback, or admin_insecure said outright.
    assert gateway("check", str(file), env={"GATEWAY_ADMIN_TOKEN": TOKEN}).returncode == 0
    assert gateway("check", str(loopback)).returncode == 0
    insecure = tmp_path / "insecure.yaml"
    insecure.write_text(policy(f"0.0.0.0:{port}", "  admin_insecure: true\n"))
    assert gateway("check", str(insecure)).returncode == 0


Spawn = Callable[..., Awaitable[Process]]


@pytest.fixture
async def in_netns(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start ``gateway ARGS`` in a network namespace of its own; killed at the end."""
    netns.need_netns()
    started: list[Process] = []

    async def start(*args: str, env: dict[str, str] | None = None) -> Process:
        log_path = tmp_path / f"gateway-{len(started)}.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *netns.in_new_netns(sys.executable, "-m", "gateway", *args),
                cwd=REPO_ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **BARE, **(env or {})},
            )
        started.append(Process(proc, log_path))
        return started[-1]

    yield start
    for running in started:
        if running.proc.returncode is None:
            running.proc.kill()
            await running.proc.wait()


async def serving(process: Process) -> None:
    """Until its start line (written once both listeners are up); fails if it exits first."""

    def started() -> bool:
        assert process.proc.returncode is None, f"exited early:\n{process.log()}"
        return " serving on " in process.log()

    await wait_until(started, "the gateway's start line", within_s=30, context=process.log)


ADMIN = f"http://{netns.ADDRESS}:9090"


async def test_an_admin_listener_on_a_lan_address_needs_a_token_or_admin_insecure(
    in_netns: Spawn, tmp_path: Path
) -> None:
    """The issue's case: admin_listen on 10.77.0.1 with no token answered POST /reload and
    /policy to anyone."""
    file = tmp_path / "lan.yaml"
    file.write_text(policy(f"{netns.ADDRESS}:9090"))
    refused = await in_netns("run", "--config", str(file))
    assert await asyncio.wait_for(refused.proc.wait(), 30) == EXIT_STARTUP
    assert refused.log() == (
        f"gateway: {file}: the admin listener on {netns.ADDRESS}:9090 (server.admin_listen) "
        f"{REFUSAL}\n"
    )

    # With a token: it starts, and the admin side answers only with it.
    guarded = await in_netns("run", "--config", str(file), env={"GATEWAY_ADMIN_TOKEN": TOKEN})
    await serving(guarded)
    pid, bearer = guarded.proc.pid, {"Authorization": f"Bearer {TOKEN}"}
    assert await netns.request(pid, "POST", ADMIN + "/reload") == 401
    assert await netns.request(pid, "GET", ADMIN + "/policy") == 401
    assert await netns.request(pid, "GET", ADMIN + "/policy", bearer) == 200
    assert await netns.request(pid, "GET", ADMIN + "/readyz") == 200
    assert "INSECURE" not in guarded.log()

    # admin_insecure: true: open, as asked, and a WARNING says so at the start.
    open_file = tmp_path / "open.yaml"
    open_file.write_text(policy(f"{netns.ADDRESS}:9090", "  admin_insecure: true\n"))
    opened = await in_netns("run", "--config", str(open_file))
    await serving(opened)
    assert await netns.request(opened.proc.pid, "GET", ADMIN + "/policy") == 200
    (warning,) = [line for line in opened.log().splitlines() if "INSECURE" in line]
    assert " WARNING " in warning
    assert f"the admin listener on {netns.ADDRESS}:9090 has no admin token" in warning
    assert "server.admin_insecure: true" in warning


async def test_a_reload_that_would_drop_the_token_is_refused(
    in_netns: Spawn, tmp_path: Path
) -> None:
    file = tmp_path / "lan.yaml"
    with_token = policy(f"{netns.ADDRESS}:9090", f"  admin_token: {TOKEN}\n")
    file.write_text(with_token)
    process = await in_netns("run", "--config", str(file))
    await serving(process)
    pid, bearer = process.proc.pid, {"Authorization": f"Bearer {TOKEN}"}
    file.write_text(policy(f"{netns.ADDRESS}:9090"))
    assert await netns.request(pid, "POST", ADMIN + "/reload", bearer) == 422
    assert await netns.request(pid, "GET", ADMIN + "/policy") == 401
    assert "policy reload failed, keeping the running policy" in process.log()
    assert f"(server.admin_listen) {REFUSAL}; the running policy stays" in process.log()
