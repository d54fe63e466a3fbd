"""Live reload: a bad edit never replaces a good policy; a good one swaps in, losing nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest
import redis
from aiohttp import web

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build
from gateway.stores import RedisStore
from gateway.stores.redis.codecs import codec_for
from tests.support import redis_harness
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordedRequest, RecordingUpstream
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server

LIMIT = (
    "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: {rate}\n    burst: {burst}\n"
    "    nodelay: true\n"
)


def write_atomically(path: Path, text: str) -> None:
    """Replace by rename, as editors and Kubernetes config maps do."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _status(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status


@pytest.mark.reliability
async def test_invalid_edit_keeps_running_policy_and_reports_exact_error(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT.format(rate="1r/m", burst=1))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    sha_before = gw.gateway.loaded.sha256
    reloader = gw.gateway.reloader
    assert reloader is not None

    write_atomically(path, policy_for(upstream.url) + LIMIT.format(rate="fast", burst=1))
    await wait_until(lambda: reloader.status.failed == 1)
    assert reloader.status.last_error == (
        f"{path}:15: limits.per_ip.rate: invalid rate 'fast': "
        "expected nginx syntax like '10r/s' or '30r/m'"
    )
    assert gw.gateway.loaded.sha256 == sha_before
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.admin_url + "/readyz") as resp:
            assert resp.status == 200
        async with session.get(gw.admin_url + "/policy") as resp:
            body = await resp.json()
            assert body["sha256"] == sha_before
            assert body["reload"]["last_result"] == "failed"
        # The old limit (burst 1) is still enforced.
        assert [await _status(session, gw.url + "/") for _ in range(3)] == [200, 200, 429]


async def test_valid_edit_swaps_policy_and_keeps_state_of_unchanged_limits(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    clock = FakeClock()
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT.format(rate="1r/m", burst=2))
    gw = await start_gateway(load_and_build(path), policy_path=str(path), clock=clock)
    reloader = gw.gateway.reloader
    assert reloader is not None
    async with aiohttp.ClientSession() as session:
        assert [await _status(session, gw.url + "/") for _ in range(4)] == [200, 200, 200, 429]

        # An unrelated change (a new route): the per_ip limit keeps its exhausted state.
        write_atomically(
            path,
            policy_for(upstream.url, extra="  - name: other\n    upstream: backend\n")
            + LIMIT.format(rate="1r/m", burst=2),
        )
        await wait_until(lambda: reloader.status.succeeded == 1)
        assert await _status(session, gw.url + "/") == 429

        # Doubling burst rescales usage proportionally: a full bucket of 3 becomes 6 of 6.
        write_atomically(path, policy_for(upstream.url) + LIMIT.format(rate="1r/m", burst=5))
        await wait_until(lambda: reloader.status.succeeded == 2)
        assert await _status(session, gw.url + "/") == 429

        # Removing the limit frees its state and stops limiting.
        write_atomically(path, policy_for(upstream.url))
        await wait_until(lambda: reloader.status.succeeded == 3)
        assert [await _status(session, gw.url + "/") for _ in range(3)] == [200, 200, 200]
        assert gw.gateway.store.tracked_keys("per_ip") == 0


async def test_admin_reload_endpoint(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    # Write in place (no rename) and ask for the reload explicitly, as SIGHUP would.
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.admin_url + "/reload") as resp:
            assert (await resp.json())["result"] == "unchanged"
        path.write_text("routes: [")
        async with session.post(gw.admin_url + "/reload") as resp:
            assert resp.status == 422
            assert (await resp.json())["error"].startswith(f"{path}:1: invalid YAML")


@pytest.mark.reliability
async def test_reload_under_load_loses_no_request(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    generous = LIMIT.format(rate="10000r/s", burst=100000)
    path.write_text(policy_for(upstream.url) + generous)
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    statuses: list[int] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(2000):  # bounded
            if stop.is_set():
                return
            try:
                statuses.append(await _status(session, gw.url + "/"))
            except aiohttp.ClientError as exc:
                errors.append(exc)

    async with aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(client(session)) for _ in range(8)]
        for i in range(6):
            await asyncio.sleep(0.15)
            route = f"  - name: r{i}\n    upstream: backend\n    match: {{path: /r{i}}}\n"
            write_atomically(path, policy_for(upstream.url, extra=route) + generous)
            await wait_until(lambda i=i: reloader.status.succeeded == i + 1)
        stop.set()
        await asyncio.gather(*clients)
    assert errors == []
    assert statuses and set(statuses) == {200}
    assert reloader.status.failed == 0


async def test_a_request_in_flight_finishes_under_the_policy_it_started_with(
    make_upstream: Callable[[], Awaitable[RecordingUpstream]],
    start_gateway: GatewayFactory,
    tmp_path: Path,
) -> None:
    """The reload swaps route, upstream and limits at once; a request already forwarded
    finishes against the old upstream with the old limit's headers, the next one is wholly
    under the new policy."""
    old, new = await make_upstream(), await make_upstream()
    release = asyncio.Event()

    async def held(request: web.BaseRequest, recorded: RecordedRequest) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="old upstream")

    old.reply = held
    limit = "limits:\n  {name}:\n    algorithm: leaky_bucket\n    rate: 10r/s\n    burst: 5\n"
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(old.url, limit.format(name="before")))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    async with aiohttp.ClientSession() as session:

        async def get() -> tuple[str, str]:
            async with session.get(gw.url + "/x") as resp:
                return await resp.text(), resp.headers.get("RateLimit-Policy", "")

        in_flight = asyncio.create_task(get())
        await wait_until(lambda: len(old.requests) == 1)
        path.write_text(policy_for(new.url, limit.format(name="after")))
        assert await reloader.reload() == "ok"
        text, policy_header = await get()
        assert text == "ok GET /x" and policy_header.startswith('"after"')
        release.set()
        text, policy_header = await asyncio.wait_for(in_flight, 5)
    assert text == "old upstream" and policy_header.startswith('"before"')
    assert [r.raw_path for r in new.requests] == ["/x"]


async def test_a_reload_logs_the_warnings_check_prints(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    caplog.set_level(logging.WARNING, logger="gateway")
    write_atomically(
        path,
        policy_for(upstream.url)
        + "limits:\n  per_key:\n    algorithm: fixed_window\n    limit: 10\n    window: 1m\n"
        "    key: ['header:X-Api-Key']\n    overrides: {key-1: {limit: 100}}\n"
        "    unlisted: reject\n",
    )
    await wait_until(lambda: reloader.status.succeeded == 1)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"{path}:19: warning: limits.per_key.unlisted: reject, but a request without "
        "header:X-Api-Key skips this limit (on_missing_key: skip, the default) rather than being "
        "rejected: set on_missing_key: client_ip to reject it as unlisted too"
    ]


async def test_a_changed_rate_rescales_state_in_redis(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """With the Redis store a reload that changes a limit's rate or burst carries its state over
    rescaled, as in process: the key stays, and the script rescales the state written under the
    old parameters the next time it meets it (replicas may reload at different moments).

    The scripts decide on a fake clock: on Redis ``TIME`` the bucket drains while the reloads
    are noticed (a few seconds on a slow machine), and the counts asserted move."""
    prefix = f"rescale-e2e{time.monotonic_ns()}:"
    store = f"store:\n  url: {redis_server.url}\n  key_prefix: '{prefix}'\n  timeout: 2s\n"
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT.format(rate="6r/m", burst=3) + store)
    clock = FakeClock()
    gw = await start_gateway(
        load_and_build(path),
        policy_path=str(path),
        clock=clock,
        # The store the policy names, on the fake clock.
        store=RedisStore(
            redis_server.url, key_prefix=prefix, timeout_s=2.0, clock=clock, time_source=clock
        ),
    )
    reloader = gw.gateway.reloader
    redis_store = gw.gateway.store
    assert reloader is not None and isinstance(redis_store, RedisStore)
    inspect = redis.Redis.from_url(redis_server.url)

    def stored() -> tuple[str, bytes]:
        (limit,) = gw.gateway.handler.runtime.engine.limits
        key = redis_store.plan(limit).redis_key("127.0.0.1")
        raw: bytes = inspect.get(key)
        return key, raw[: len(codec_for(limit.algorithm).params)]

    async def remaining(session: aiohttp.ClientSession) -> int:
        params = {"path": "/", "client_ip": "127.0.0.1"}
        async with session.get(gw.admin_url + "/explain", params=params) as resp:
            (limit,) = (await resp.json())["limits"]
            value: int = limit["next_request"]["remaining"]
            return value

    try:
        async with aiohttp.ClientSession() as session:
            assert [await _status(session, gw.url + "/") for _ in range(2)] == [200, 200]
            assert await remaining(session) == 1  # 2 of the 4 (burst 3 + 1) in use
            key_before, params_before = stored()

            # Twice the rate: as full as before (it only drains faster from now on). Starting
            # afresh would leave 3.
            write_atomically(
                path, policy_for(upstream.url) + LIMIT.format(rate="12r/m", burst=3) + store
            )
            await wait_until(lambda: reloader.status.succeeded == 1)
            assert await remaining(session) == 1
            assert stored() == (key_before, params_before)  # a look rewrites nothing

            # Twice the capacity (burst 7, so 8): 2 of 4 in use becomes 4 of 8. Afresh: 7.
            write_atomically(
                path, policy_for(upstream.url) + LIMIT.format(rate="12r/m", burst=7) + store
            )
            await wait_until(lambda: reloader.status.succeeded == 2)
            assert await remaining(session) == 3
            assert await _status(session, gw.url + "/") == 200
            key_after, params_after = stored()
            assert key_after == key_before and params_after != params_before
            assert await remaining(session) == 2
    finally:
        inspect.close()


async def test_other_files_changing_beside_the_policy_do_not_reload_it(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A log file (or anything else) written next to the policy file is no reason to re-read
    the policy: each reload logs a line, so a log beside the policy would reload in a loop."""
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT.format(rate="1r/m", burst=1))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    neighbour = tmp_path / "gateway.log"
    for i in range(10):
        neighbour.write_text(f"line {i}\n")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    status = reloader.status
    assert (status.succeeded, status.unchanged, status.failed) == (0, 0, 0)
    write_atomically(path, policy_for(upstream.url) + LIMIT.format(rate="2r/m", burst=1))
    await wait_until(lambda: reloader.status.succeeded == 1)


async def test_an_empty_or_routeless_file_is_refused_and_the_policy_stays(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A template that rendered empty, or an editor that truncated before writing, must not
    take the site down: the running policy stays, limit state and readiness with it."""
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT.format(rate="1r/m", burst=1))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    sha_before = gw.gateway.loaded.sha256
    async with aiohttp.ClientSession() as session:
        assert await _status(session, gw.url + "/") == 200
        for text in ("", "version: 1\n"):
            path.write_text(text)
            async with session.post(gw.admin_url + "/reload") as resp:
                assert resp.status == 422
                assert "routes nothing" in (await resp.json())["error"]
            assert gw.gateway.loaded.sha256 == sha_before
            assert await _status(session, gw.admin_url + "/readyz") == 200
        # The limit's state survived: the second request of the minute is still refused.
        assert [await _status(session, gw.url + "/") for _ in range(2)] == [200, 429]


async def test_reverting_a_bad_edit_clears_the_failure(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Restoring the running content is a return to a valid state, not "nothing happened":
    the stale error must not stay on /policy, /reload and the dashboard."""
    path = tmp_path / "policy.yaml"
    good = policy_for(upstream.url)
    path.write_text(good)
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    async with aiohttp.ClientSession() as session:
        path.write_text("routes: [")
        async with session.post(gw.admin_url + "/reload") as resp:
            assert resp.status == 422
        failed_at = reloader.status.last_attempt_at
        path.write_text(good)
        async with session.post(gw.admin_url + "/reload") as resp:
            assert resp.status == 200
            assert await resp.json() == {"result": "unchanged", "error": None}
        async with session.get(gw.admin_url + "/policy") as resp:
            status = (await resp.json())["reload"]
    assert status["last_result"] == "ok"
    assert status["last_error"] is None
    assert failed_at is not None and status["last_success_at"] >= failed_at


async def test_settings_that_need_a_restart_are_refused_and_policy_shows_what_is_in_force(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A bound listener or a forked worker count cannot move on reload: saying "ok" while
    nothing moved left /policy showing values not in force."""
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url))
    gw = await start_gateway(
        load_and_build(path), policy_path=str(path), listen="127.0.0.1:0"
    )  # a command-line --listen override
    reloader = gw.gateway.reloader
    assert reloader is not None
    async with aiohttp.ClientSession() as session:
        moved = policy_for(upstream.url, server="  workers: 2\n").replace(
            "admin_listen: 127.0.0.1:0", "admin_listen: 127.0.0.1:9999"
        )
        path.write_text(moved)
        async with session.post(gw.admin_url + "/reload") as resp:
            assert resp.status == 422
            assert (await resp.json())["error"] == (
                f"{path}: server.admin_listen ('127.0.0.1:0' -> '127.0.0.1:9999'), server.workers "
                "(1 -> 2) take effect on restart only; the running policy stays (restart the "
                "gateway to apply them, or revert them to reload the rest)"
            )
        async with session.get(gw.admin_url + "/policy") as resp:
            body = await resp.json()
        in_force = {
            "listen": f"127.0.0.1:{gw.port}",
            "admin_listen": f"127.0.0.1:{gw.gateway.admin_port}",
            "workers": 1,
            "shutdown_timeout": 30.0,
        }
        assert body["in_force"] == in_force
        assert {k: body["policy"]["server"][k] for k in in_force} == in_force
        path.write_text(policy_for(upstream.url, server="  workers: 2\n"))
        async with session.post(gw.admin_url + "/reload") as resp:
            assert (await resp.json())["error"] == (
                f"{path}: server.workers (1 -> 2) takes effect on restart only; the running "
                "policy stays (restart the gateway to apply it, or revert it to reload the rest)"
            )

        # Connection settings do apply on reload, to connections opened afterwards.
        path.write_text(policy_for(upstream.url, server="  header_timeout: 3s\n"))
        async with session.post(gw.admin_url + "/reload") as resp:
            assert (await resp.json()) == {"result": "ok", "error": None}
    assert gw.gateway.server.header_timeout == 3.0


def test_a_log_file_beside_the_policy_stays_quiet_while_idle(tmp_path: Path) -> None:
    """The file watcher's library logs each change it sees; with the gateway's log in the
    watched directory each of those lines was the next change (about 10 lines a second)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_for("http://127.0.0.1:9"))
    log = tmp_path / "gateway.log"
    with log.open("a") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(policy)],
            stdout=stderr,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)  # the watcher is up well within this
        with log.open("a") as writer:  # another writer (or a request's log line) starts it
            writer.write("a line from elsewhere\n")
        time.sleep(0.5)
        before = log.read_text().count("\n")
        time.sleep(3)
        after = log.read_text()
        assert after.count("\n") == before, after
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_policy_shows_its_times_in_rfc_3339_beside_the_epoch_seconds(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    path.write_text(policy_for(upstream.url, server="  header_timeout: 3s\n"))
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.admin_url + "/reload") as resp:
            assert (await resp.json())["result"] in ("ok", "unchanged")  # the watcher may be first
        async with session.get(gw.admin_url + "/policy") as resp:
            body = await resp.json()

    def parsed(text: str) -> float:
        assert text.endswith("Z"), text
        return datetime.fromisoformat(text).timestamp()

    assert parsed(body["loaded_at_rfc3339"]) == pytest.approx(body["loaded_at"], abs=0.001)
    reload = body["reload"]
    for name in ("last_success_at", "last_attempt_at"):
        assert parsed(reload[name + "_rfc3339"]) == pytest.approx(reload[name], abs=0.001)
