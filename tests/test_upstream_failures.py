"""Upstream failures where an operator looks: one error line per cause naming the upstream,
server, address and cause (refused, timeout, TLS verification, reset), ``/status`` with each
upstream's recent failures, and ``https://`` upstreams with a private CA and a client
certificate. Real upstreams, real TLS, real clients over loopback."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import PolicyError
from tests.support.certificates import TLSFiles, make_tls_files
from tests.support.gateways import GatewayFactory
from tests.support.network import TIMEOUT, free_port
from tests.support.policies import policy_for


@pytest.fixture
def tls(tmp_path: Path) -> TLSFiles:
    directory = tmp_path / "tls"
    directory.mkdir()
    return make_tls_files(directory)


def _upstream_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.upstream"]


async def _statuses(url: str, count: int) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(count):
            async with session.get(url) as resp:
                statuses.append(resp.status)
                body = await resp.json()
                assert "backend" in body["detail"]  # the upstream is named, not its address
    return statuses


async def _status(admin_url: str) -> Any:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(admin_url + "/status") as resp,
    ):
        assert resp.status == 200
        return await resp.json()


async def test_a_closed_port_is_one_error_line_naming_upstream_address_and_cause(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()  # nothing listens there
    gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
    assert await _statuses(gw.url + "/", 20) == [502] * 20
    # Twenty failures of one cause in well under the interval: one line.
    assert _upstream_lines(caplog) == [
        f"upstream backend failed: connection refused (cause refused, server "
        f"http://127.0.0.1:{port}, address 127.0.0.1:{port})"
    ]
    assert [r.levelname for r in caplog.records if r.name == "gateway.upstream"] == ["ERROR"]

    status = await _status(gw.admin_url)
    backend = status["upstreams"]["backend"]
    assert backend["url"] == f"http://127.0.0.1:{port}"
    assert backend["failures"] == {"refused": 20} and backend["failures_total"] == 20
    assert len(backend["recent"]) == 10
    latest = backend["recent"][0]
    assert latest["address"] == f"127.0.0.1:{port}"
    assert latest["at_rfc3339"].endswith("Z") and latest["cause"] == "refused"
    # The dashboard shows the same, as failing.
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/dashboard/state") as resp,
    ):
        shown = (await resp.json())["state"]["upstreams"]["backend"]
    assert shown["failures_total"] == 20 and shown["recent"][0]["cause"] == "refused"
    # /readyz is about the gateway: still ready.
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/readyz") as resp,
    ):
        assert resp.status == 200


async def _server(handler: Any, ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    return runner


async def test_timeouts_and_resets_are_named_as_such(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    async def cut(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    slow, broken = await _server(silent), await _server(cut)
    try:
        extra = policy_for(f"http://127.0.0.1:{broken.addresses[0][1]}").split("routes:")[0]
        extra = extra.split("upstreams:\n")[1].replace("backend:", "broken:")
        text = policy_for(f"http://127.0.0.1:{slow.addresses[0][1]}").replace(
            "    read_timeout: 5s\n", "    read_timeout: 200ms\n" + extra
        )
        text += "  - name: b\n    match: {path_prefix: /b}\n    upstream: broken\n"
        text = text.replace("  - name: all\n    upstream: backend\n", "") + (
            "  - name: all\n    upstream: backend\n"
        )
        gw = await start_gateway(text)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(gw.url + "/") as resp:
                assert resp.status == 504
            async with session.get(gw.url + "/b") as resp:
                assert resp.status == 502
        lines = _upstream_lines(caplog)
        assert len(lines) == 2, lines
        assert lines[0].startswith(
            "upstream backend failed: the upstream sent nothing within the read timeout "
            "(cause timeout"
        )
        assert lines[1].startswith(
            "upstream broken failed: the upstream closed the connection before answering"
        )
        assert "(cause reset" in lines[1]
        status = await _status(gw.admin_url)
        assert status["upstreams"]["backend"]["failures"] == {"timeout": 1}
        assert status["upstreams"]["broken"]["failures"] == {"reset": 1}
    finally:
        await slow.cleanup()
        await broken.cleanup()


def _https_policy(port: int, upstream: str = "") -> str:
    return policy_for(f"https://127.0.0.1:{port}").replace(
        "    read_timeout: 5s\n", "    read_timeout: 5s\n" + upstream
    )


async def test_https_upstream_with_a_private_ca_and_a_client_certificate(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture, tls: TLSFiles
) -> None:
    """Mutual TLS: the upstream's certificate is signed by a private CA, and the upstream
    requires the gateway's client certificate."""
    presented: list[str] = []

    async def hello(request: web.Request) -> web.Response:
        assert request.transport is not None
        peer = request.transport.get_extra_info("peercert")
        presented.append(dict(field[0] for field in peer["subject"])["commonName"])
        return web.json_response({"ok": True})

    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    server_context.load_cert_chain(tls.server_cert, tls.server_key)
    server_context.verify_mode = ssl.CERT_REQUIRED
    runner = await _server(hello, server_context)
    port = runner.addresses[0][1]
    try:
        # Without ca_file: verified against the system's CAs, which do not know this one.
        gw = await start_gateway(_https_policy(port))
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.get(gw.url + "/") as resp,
        ):
            assert resp.status == 502
        (line,) = _upstream_lines(caplog)
        # OpenSSL's words for the problem (here the chain ends in a CA it does not trust).
        problem = "self-signed certificate in certificate chain"
        assert line == (
            f"upstream backend failed: TLS certificate verification failed: {problem} (set the "
            "upstream's ca_file to the CA that signed its certificate) (cause tls, server "
            f"https://127.0.0.1:{port}, address 127.0.0.1:{port})"
        )
        # With the CA but no client certificate: the upstream refuses the gateway.
        caplog.clear()
        gw = await start_gateway(_https_policy(port, f"    ca_file: {tls.ca}\n"))
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.get(gw.url + "/") as resp,
        ):
            assert resp.status == 502
        (line,) = _upstream_lines(caplog)
        assert line == (
            "upstream backend failed: the upstream closed the connection before answering (an "
            "https server that requires a client certificate does this: see client_cert) "
            f"(cause reset, server https://127.0.0.1:{port}, address 127.0.0.1:{port})"
        )
        assert presented == []
        # Both: served.
        client = f"    ca_file: {tls.ca}\n    client_cert: {tls.client_cert}\n"
        client += f"    client_key: {tls.client_key}\n"
        gw = await start_gateway(_https_policy(port, client))
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.get(gw.url + "/") as resp,
        ):
            assert resp.status == 200
            assert await resp.json() == {"ok": True}
        assert presented == ["gateway-client"]
    finally:
        await runner.cleanup()


def test_tls_files_are_checked_like_the_rest_of_the_policy(tls: TLSFiles, tmp_path: Path) -> None:
    """Relative to the policy file; a missing file, a file that holds no certificate, a key
    of another certificate, and TLS settings on an http:// upstream are refused with the
    line."""
    policy = tmp_path / "policy.yaml"
    cases = {
        "    ca_file: tls/ca.pem\n": None,
        "    ca_file: tls/missing.pem\n": "policy.yaml:9: upstreams.backend.ca_file: cannot "
        f"read {tmp_path}/tls/missing.pem: no such file or directory",
        "    ca_file: tls/server.key\n": "policy.yaml:9: upstreams.backend.ca_file: "
        f"{tmp_path}/tls/server.key holds no PEM CA certificate",
        "    client_cert: tls/client.pem\n    client_key: tls/server.key\n": "policy.yaml:9: "
        f"upstreams.backend.client_cert: {tmp_path}/tls/client.pem: the key does not belong "
        "to this certificate",
        "    client_key: tls/client.key\n": "policy.yaml:5: upstreams.backend: client_key "
        "without client_cert: give the certificate it belongs to",
    }
    for settings, expected in cases.items():
        policy.write_text(_https_policy(443, settings))
        if expected is None:
            loaded = parse_and_build(policy.read_text(), str(policy))
            assert loaded.policy.upstreams["backend"].ca_file == str(tls.ca)
            continue
        with pytest.raises(PolicyError) as raised:
            parse_and_build(policy.read_text(), str(policy))
        assert str(raised.value).startswith(f"{tmp_path}/{expected}"), str(raised.value)
    text = policy_for("http://127.0.0.1:8000").replace(
        "    read_timeout: 5s\n", "    read_timeout: 5s\n    ca_file: /etc/ssl/ca.pem\n"
    )
    with pytest.raises(PolicyError) as raised:
        parse_and_build(text, "p.yaml")
    assert str(raised.value) == (
        "p.yaml:5: upstreams.backend: ca_file: TLS settings are for https:// servers, and this "
        "upstream has none (http://127.0.0.1:8000)"
    )


async def test_a_pool_logs_the_server_that_failed_while_another_answers(
    make_upstream: Any, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Per server: the request went on to the live server (200), and the refused one is
    logged and shown with its own address."""
    alive = await make_upstream()
    dead_port = free_port()
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  pool:\n    servers: [http://127.0.0.1:{dead_port}, {alive.url}]\n"
        "routes:\n  - name: all\n    upstream: pool\n"
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = []
        for _ in range(4):
            async with session.get(gw.url + "/") as resp:
                statuses.append(resp.status)
    assert statuses == [200] * 4
    (line,) = _upstream_lines(caplog)[:1]
    assert line == (
        f"upstream pool failed: connection refused (cause refused, server "
        f"http://127.0.0.1:{dead_port}, address 127.0.0.1:{dead_port})"
    )
    recent = (await _status(gw.admin_url))["upstreams"]["pool"]["recent"]
    assert {failure["address"] for failure in recent} == {f"127.0.0.1:{dead_port}"}


@pytest.mark.reliability
async def test_a_get_lost_in_flight_on_a_kept_alive_connection_is_a_reset_not_a_connect_failure(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream that takes a GET on a kept-alive connection, works on it 200 ms and dies
    (closes, and refuses new connections): the gateway sends it again on a new connection, as
    it may, and is refused. The request went out, so the failure is a ``reset`` and the line
    says how long it was in flight, not ``connect`` and "closed an idle keep-alive connection"
    (a failure that sent nothing, which a retry rule would send on whatever the method)."""
    caplog.set_level(logging.INFO)
    served: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            served.append(1)
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(0.2)  # in flight at the upstream, then it dies
            server.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(gw.url + "/first") as resp:
            assert resp.status == 200 and await resp.read() == b"ok"
        async with session.get(gw.url + "/second") as resp:
            assert resp.status == 502
    server.close()
    (line,) = _upstream_lines(caplog)
    assert "(cause reset," in line, line
    assert "idle" not in line and "ms after the request was sent" in line, line
    backend = (await _status(gw.admin_url))["upstreams"]["backend"]
    assert backend["failures"] == {"reset": 1}, backend["failures"]
    pool = gw.gateway.handler.runtime.upstreams["backend"].pool
    assert pool.members[0].stats.failures == {"reset": 1}
