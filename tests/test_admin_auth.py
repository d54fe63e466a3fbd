"""The admin listener's bearer token, with real HTTP clients (aiohttp, and Debian's Chromium for
the dashboard's sign-in), and the secrets kept out of ``/policy`` and the logs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml
from playwright.async_api import Browser

from gateway.admin.auth import COOKIE, AdminTokenError, resolve_admin_token
from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import LoadedPolicy, PolicyError
from gateway.policy.models import Policy, ServerSettings
from gateway.serving.lifecycle import Gateway, StartupError
from gateway.stores import MemoryStore
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.processes import parent_pid, run_workers
from tests.support.upstreams import RecordingUpstream

TOKEN = "s3cret-admin-token-0123456789"
TIMEOUT = aiohttp.ClientTimeout(total=10)
LIMIT = "limits:\n  per_ip:\n    algorithm: fixed_window\n    limit: 1\n    window: 1h\n"

# Every admin endpoint, by method and path, that the token guards by default.
GUARDED = [
    ("GET", "/policy"),
    ("POST", "/reload"),
    ("GET", "/explain?path=/x"),
    ("GET", "/dashboard/"),
    ("GET", "/dashboard/state"),
    ("GET", "/dashboard/events"),
    ("GET", "/dashboard/static/dashboard.js"),
    ("GET", "/status"),
]
OPEN = ["/healthz", "/readyz", "/metrics"]


def _with_token(upstream_url: str, server: str = f"  admin_token: {TOKEN}\n") -> str:
    return policy_for(upstream_url, LIMIT, server=server)


async def _status(session: aiohttp.ClientSession, method: str, url: str, **kwargs: object) -> int:
    async with session.request(method, url, allow_redirects=False, **kwargs) as resp:  # type: ignore[arg-type]
        return resp.status


async def test_guarded_endpoints_need_the_bearer_token_and_probes_stay_open(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_with_token(upstream.url))
    good = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method, path in GUARDED:
            url = gw.admin_url + path
            async with session.request(method, url, allow_redirects=False) as resp:
                assert resp.status == 401, path
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            for wrong in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN):
                assert await _status(session, method, url, headers={"Authorization": wrong}) == 401
            if path == "/dashboard/events":
                async with session.get(url, headers=good) as resp:
                    assert resp.status == 200
                    assert (await resp.content.readuntil(b"\n\n")).startswith(b"event: init")
                continue
            # /reload answers 409 here: the gateway was started without a policy file.
            assert await _status(session, method, url, headers=good) in (200, 409), path
        for path in OPEN:
            assert await _status(session, "GET", gw.admin_url + path) == 200, path


async def test_without_a_token_the_admin_listener_stays_open(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, LIMIT))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method, path in GUARDED:
            if path != "/dashboard/events":
                assert await _status(session, method, gw.admin_url + path) in (200, 409), path


async def test_public_paths_are_configurable(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    server = f"  admin_token: {TOKEN}\n  admin_public_paths: [/healthz, /dashboard]\n"
    gw = await start_gateway(_with_token(upstream.url, server))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert await _status(session, "GET", gw.admin_url + "/healthz") == 200
        assert await _status(session, "GET", gw.admin_url + "/dashboard/state") == 200
        assert await _status(session, "GET", gw.admin_url + "/readyz") == 401
        assert await _status(session, "GET", gw.admin_url + "/metrics") == 401
        assert await _status(session, "GET", gw.admin_url + "/policy") == 401
    with pytest.raises(PolicyError, match="admin_public_paths"):
        parse_and_build(_with_token(upstream.url, "  admin_public_paths: [/reload]\n"), "t.yaml")


async def test_browser_signs_in_with_a_form_and_gets_a_get_only_cookie(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_with_token(upstream.url))
    jar = aiohttp.CookieJar(unsafe=True)  # cookies for an IP address host
    async with aiohttp.ClientSession(timeout=TIMEOUT, cookie_jar=jar) as session:
        page = gw.admin_url + "/dashboard/"
        async with session.get(page, headers={"Accept": "text/html"}, allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/login"
        async with session.post(gw.admin_url + "/login", data={"token": "wrong" * 4}) as r:
            assert r.status == 401
        assert not jar.filter_cookies(gw.admin_url)  # type: ignore[arg-type]
        async with session.post(
            gw.admin_url + "/login", data={"token": TOKEN}, allow_redirects=False
        ) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/dashboard/"
            cookie = r.cookies[COOKIE]
            assert cookie["httponly"] is True
            assert cookie["samesite"] == "Strict"
            assert TOKEN not in cookie.value
        assert await _status(session, "GET", page) == 200
        assert await _status(session, "GET", gw.admin_url + "/dashboard/state") == 200
        assert await _status(session, "GET", gw.admin_url + "/policy") == 200
        async with session.get(gw.admin_url + "/dashboard/events") as resp:
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"event: init")
        # The cookie opens reads only: a page on another site cannot make a signed-in
        # browser reload the policy (SameSite=Strict aside).
        assert await _status(session, "POST", gw.admin_url + "/reload") == 401
        # A forged cookie opens nothing.
        forged = {"Cookie": f"{COOKIE}={'0' * 64}"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as fresh:
        assert await _status(fresh, "GET", gw.admin_url + "/policy", headers=forged) == 401


async def test_dashboard_works_in_chromium_after_signing_in(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, browser: Browser
) -> None:
    gw = await start_gateway(_with_token(upstream.url))
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    await page.goto(gw.admin_url + "/dashboard/")
    assert page.url == gw.admin_url + "/login"
    await page.fill("input[name=token]", TOKEN)
    await page.click("button[type=submit]")
    await page.wait_for_url(gw.admin_url + "/dashboard/")
    # The live feed arrives (the limit's card is drawn from it) and counts a rejection.
    await page.wait_for_selector("#limit-per_ip", timeout=8000)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(3):
            async with session.get(gw.url + "/x") as resp:
                await resp.read()
    await page.wait_for_function(
        "document.querySelector('#limit-per_ip [data-field=\"rejected-total\"]')"
        " && document.querySelector('#limit-per_ip [data-field=\"rejected-total\"]')"
        ".textContent.trim() !== '0'",
        timeout=8000,
    )
    assert not errors, errors
    assert not any(TOKEN in url for url in requested), "the token went into a URL"
    await page.close()


async def test_token_from_environment_or_file_and_rotated_by_reload(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")  # a trailing newline, as `echo` leaves it
    policy = _with_token(upstream.url, f"  admin_token_file: {token_file}\n")
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        url = gw.admin_url + "/policy"
        old = {"Authorization": f"Bearer {TOKEN}"}
        assert await _status(session, "GET", url, headers=old) == 200
        assert await _status(session, "GET", url) == 401
        # Rotation: a new file and a reload; the old token stops working at once.
        token_file.write_text("a-brand-new-token-987654321")
        gw.gateway.apply(parse_and_build(policy + "# reloaded\n", "t.yaml"))
        assert await _status(session, "GET", url, headers=old) == 401
        new = {"Authorization": "Bearer a-brand-new-token-987654321"}
        assert await _status(session, "GET", url, headers=new) == 200
        # An unreadable file on reload: refused, and the running token stays.
        token_file.unlink()
        with pytest.raises(AdminTokenError, match=r"admin token file .*admin-token: cannot read"):
            gw.gateway.apply(parse_and_build(policy + "# again\n", "t.yaml"))
        assert await _status(session, "GET", url, headers=new) == 200

    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "token-from-the-environment")
    gw2 = await start_gateway(policy_for(upstream.url, LIMIT))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        url = gw2.admin_url + "/policy"
        assert await _status(session, "GET", url) == 401
        env = {"Authorization": "Bearer token-from-the-environment"}
        assert await _status(session, "GET", url, headers=env) == 200


def test_unusable_tokens_are_refused_with_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(AdminTokenError, match="shorter than 16 characters"):
        resolve_admin_token(ServerSettings(), {"GATEWAY_ADMIN_TOKEN": "short"})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(AdminTokenError, match=f"admin token file {empty}: the file is empty"):
        resolve_admin_token(ServerSettings(admin_token_file=str(empty)), {})
    with pytest.raises(AdminTokenError, match="No such file or directory"):
        resolve_admin_token(ServerSettings(), {"GATEWAY_ADMIN_TOKEN_FILE": str(tmp_path / "no")})
    with pytest.raises(StartupError, match="No such file"):
        Gateway(
            parse_and_build(
                policy_for("http://127.0.0.1:1", server="  admin_token_file: /no\n"), "t"
            )
        )
    with pytest.raises(PolicyError, match="admin_token or admin_token_file, not both"):
        parse_and_build(
            policy_for(
                "http://127.0.0.1:1", server=f"  admin_token: {TOKEN}\n  admin_token_file: /x\n"
            ),
            "t.yaml",
        )


async def test_policy_endpoint_and_logs_never_show_secrets(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    store = (
        "store:\n  url: redis://gwuser:redis-pass-1@127.0.0.1:1/0?password=redis-pass-2\n"
        "  on_failure: allow\n"
    )
    monkeypatch.setenv("GATEWAY_STORE_URL", "redis://:redis-pass-3@127.0.0.1:1/0")
    gw = await start_gateway(_with_token(upstream.url) + store, store=MemoryStore())
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(gw.admin_url + "/policy", headers=headers) as resp:
            text = await resp.text()
            body = await resp.json()
        async with session.get(gw.admin_url + "/dashboard/state", headers=headers) as resp:
            text += await resp.text()
        for attempt in ("Bearer nope-nope-nope-nope", f"Bearer {TOKEN}"):
            await _status(
                session, "GET", gw.admin_url + "/explain", headers={"Authorization": attempt}
            )
    for secret in ("redis-pass-1", "redis-pass-2", "redis-pass-3", TOKEN):
        assert secret not in text, secret
        assert secret not in caplog.text, secret
    assert body["policy"]["store"]["url"] == ("redis://gwuser:***@127.0.0.1:1/0?password=***")
    assert body["store_url"] == "redis://:***@127.0.0.1:1/0"
    assert body["policy"]["server"]["admin_token"] == "***"
    # A policy error about the store URL does not repeat its password either.
    with pytest.raises(PolicyError) as caught:
        parse_and_build(policy_for(upstream.url) + "store:\n  url: redis//:pw-in-error@h/0\n", "t")
    assert "pw-in-error" not in str(caught.value)
    assert "invalid store url" in str(caught.value)


def test_a_store_url_the_client_refuses_is_one_line_without_its_password() -> None:
    store = "store:\n  url: redis+cluster://:cluster-pass-9@127.0.0.1:1/1\n"
    text = policy_for("http://127.0.0.1:1") + store
    # In `gateway check`, `run` and a reload, through the loader:
    with pytest.raises(PolicyError) as caught:
        parse_and_build(text, "t.yaml")
    assert "cluster-pass-9" not in str(caught.value)
    assert "got 'redis://***@127.0.0.1:1/1'" in str(caught.value)
    # And a gateway built from a policy that did not come through the loader:
    policy = Policy.model_validate(yaml.safe_load(text))
    with pytest.raises(StartupError) as started:
        Gateway(LoadedPolicy(policy=policy, source="t.yaml", sha256="0" * 64))
    assert str(started.value) == (
        "store: a Redis Cluster has only database 0, got 'redis://***@127.0.0.1:1/1'"
    )


async def test_the_admin_root_sends_a_browser_to_the_dashboard(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, LIMIT))
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/", allow_redirects=False) as resp,
    ):
        assert resp.status == 302 and resp.headers["Location"] == "/dashboard/"


ROTATED = "a-rotated-admin-token-5550123"


async def _statuses(admin_url: str, headers: dict[str, str], connections: int = 20) -> set[int]:
    """``GET /policy`` on ``connections`` new connections (SO_REUSEPORT spreads them over the
    workers: all on one of two, one time in 2**19); the statuses seen."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        return {
            await _status(session, "GET", admin_url + "/policy", headers=headers)
            for _ in range(connections)
        }


async def _wait_for_log(log: Path, text: str, count: int, within_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while (found := await asyncio.to_thread(log.read_text)).count(text) < count:
        assert loop.time() < deadline, f"{count} x {text!r} not logged: {found}"
        await asyncio.sleep(0.1)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("source", "trigger"),
    [("admin_token_file", "SIGHUP"), ("GATEWAY_ADMIN_TOKEN_FILE", "POST /reload")],
)
async def test_rewriting_the_token_file_rotates_the_token_in_every_worker(
    upstream: RecordingUpstream, tmp_path: Path, source: str, trigger: str
) -> None:
    """``gateway run --workers 2``: the token file rewritten, the policy file untouched, then
    SIGHUP to the supervisor or ``POST /reload`` (which one worker answers): from then on the
    old token and a cookie signed in with it get 401 on both workers, the new token 200.
    (Before, an unchanged policy returned "unchanged" before the file was read again: the old
    token kept working and the new one got 401.)"""
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    server = f"  admin_token_file: {token_file}\n" if source == "admin_token_file" else ""
    env = {"GATEWAY_ADMIN_TOKEN_FILE": str(token_file)} if server == "" else {}
    async with run_workers(upstream.url, tmp_path, LIMIT, 2, server=server, env=env) as (
        _,
        admin,
        pids,
    ):
        log = tmp_path / "gateway.log"
        await _wait_for_log(log, "serving on", 2, within_s=60)
        old = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(admin + "/login", data={"token": TOKEN}, allow_redirects=False) as resp,
        ):
            assert resp.status == 303
            cookie = {"Cookie": f"{COOKIE}={resp.cookies[COOKIE].value}"}
        assert await _statuses(admin, old) == {200}
        assert await _statuses(admin, cookie) == {200}

        token_file.write_text(ROTATED + "\n")
        if trigger == "SIGHUP":
            os.kill(parent_pid(pids()[0]), signal.SIGHUP)
        else:
            async with (
                aiohttp.ClientSession(timeout=TIMEOUT) as session,
                session.post(admin + "/reload", headers=old) as resp,
            ):
                assert (resp.status, (await resp.json())["result"]) == (200, "ok")
        await _wait_for_log(log, "the token is rotated", 2)
        assert await _statuses(admin, old) == {401}
        assert await _statuses(admin, cookie) == {401}
        assert await _statuses(admin, {"Authorization": f"Bearer {ROTATED}"}) == {200}
    logged = await asyncio.to_thread(log.read_text)
    assert ROTATED not in logged and TOKEN not in logged
