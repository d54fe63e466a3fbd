"""Several listeners in one policy, as nginx has them: plain and TLS side by side, a plain one
that redirects to HTTPS, several certificates on one TLS listener chosen by SNI, each reloaded
on its own. Real clients (aiohttp, the ssl module, raw sockets) over loopback."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.edge.tls import ServerNames
from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import parse_policy
from gateway.policy.models import Certificate, TlsSettings
from tests.support.certificates import TLSFiles, make_named_certificate, make_tls_files
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.network import TIMEOUT, free_port
from tests.support.processes import REPO_ROOT, StartGateway, exit_code
from tests.support.rawhttp import exchange, split_head, status_of
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until


def listeners_policy(upstream_url: str, listeners: str, server: str = "", extra: str = "") -> str:
    """A policy whose ``server.listen`` is the list ``listeners`` (YAML lines under it)."""
    return (
        "server:\n  admin_listen: 127.0.0.1:0\n  listen:\n"
        + listeners
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n    connect_timeout: 2s\n"
        "    read_timeout: 5s\n"
        "routes:\n  - name: all\n    upstream: backend\n" + extra
    )


def fingerprint(cert: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert.read_text())).hexdigest()


def trusting(ca: Path) -> ssl.SSLContext:
    """A client that verifies the certificate against the test CA, and its names."""
    return ssl.create_default_context(cafile=str(ca))


def unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def served(port: int, server_name: str | None, ca: Path | None = None) -> str:
    """The certificate a new handshake gets (sha256 of its DER) when the client sends
    ``server_name`` as SNI (None: none); with ``ca``, verified for that name too."""
    context = trusting(ca) if ca is not None and server_name else unverified()
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_name or ""
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return hashlib.sha256(der).hexdigest()


def port_of(gw: RunningGateway, index: int) -> int:
    return gw.gateway.listeners[index].bound_port


@pytest.fixture
def tls_files(tmp_path: Path) -> TLSFiles:
    return make_tls_files(tmp_path)


async def test_a_plain_and_a_tls_listener_both_proxy(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tls_files: TLSFiles
) -> None:
    listeners = (
        "    - address: 127.0.0.1:0\n"
        "    - address: 127.0.0.1:0\n"
        f"      tls: {{cert: {tls_files.server_cert}, key: {tls_files.server_key}}}\n"
    )
    gw = await start_gateway(listeners_policy(upstream.url, listeners))
    plain, secure = port_of(gw, 0), port_of(gw, 1)
    assert plain != secure and gw.port == plain
    connector = aiohttp.TCPConnector(ssl=trusting(tls_files.ca))
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        async with session.get(f"http://127.0.0.1:{plain}/a") as resp:
            assert (resp.status, await resp.text()) == (200, "ok GET /a")
        async with session.get(f"https://127.0.0.1:{secure}/b") as resp:
            assert (resp.status, await resp.text()) == (200, "ok GET /b")
        async with session.get(gw.admin_url + "/policy") as resp:
            listen = (await resp.json())["policy"]["server"]["listen"]
    protos = [dict(r.raw_headers)[b"X-Forwarded-Proto"] for r in upstream.requests]
    assert protos == [b"http", b"https"]
    # /policy shows each listener where it is bound.
    assert [entry["address"] for entry in listen] == [
        f"127.0.0.1:{plain}",
        f"127.0.0.1:{secure}",
    ]


def _redirect_policy(upstream_url: str, files: TLSFiles, redirect: str = "true") -> str:
    listeners = (
        f"    - address: 127.0.0.1:0\n      redirect_to_https: {redirect}\n"
        "    - address: 127.0.0.1:0\n"
        f"      tls: {{cert: {files.server_cert}, key: {files.server_key}}}\n"
    )
    # A limit no redirect may count against: one request a minute per client.
    limits = (
        "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 0\n"
        "    nodelay: true\n    key: [client_ip]\n"
    )
    return listeners_policy(upstream_url, listeners, extra=limits)


def _location(response: bytes) -> str:
    headers, _ = split_head(response)
    return dict(headers)[b"Location"].decode()


async def test_a_plain_listener_redirects_to_the_tls_one_keeping_path_and_query(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tls_files: TLSFiles
) -> None:
    gw = await start_gateway(_redirect_policy(upstream.url, tls_files))
    plain, secure = port_of(gw, 0), port_of(gw, 1)

    async def ask(head: str) -> bytes:
        return await exchange(plain, head.encode() + b"\r\n", read_for=5)

    # GET and HEAD: 301; the Host's port replaced by the TLS listener's, path and query kept.
    for _ in range(3):  # never rate-limited: the limit allows one a minute
        answer = await ask("GET /a/b%20c?x=1&y=two HTTP/1.1\r\nHost: shop.example:8080\r\n")
        assert status_of(answer) == 301
        assert _location(answer) == f"https://shop.example:{secure}/a/b%20c?x=1&y=two"
    answer = await ask("HEAD / HTTP/1.1\r\nHost: [::1]\r\n")
    assert (status_of(answer), _location(answer)) == (301, f"https://[::1]:{secure}/")
    # Other methods: 308, which keeps the method and the body.
    answer = await ask("POST /form?q HTTP/1.1\r\nHost: a.example\r\nContent-Length: 3\r\n\r\nabc")
    assert (status_of(answer), _location(answer)) == (308, f"https://a.example:{secure}/form?q")
    # No Host, two Hosts, a Host that is not a host, an absolute target naming another host:
    # 400, never a Location elsewhere.
    for head in (
        "GET / HTTP/1.0\r\n",
        "GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n",
        "GET / HTTP/1.1\r\nHost: evil.example/x\r\n",
        "GET / HTTP/1.1\r\nHost: a@evil.example\r\n",
        "GET http://evil.example/ HTTP/1.1\r\nHost: a.example\r\n",
    ):
        answer = await ask(head)
        assert status_of(answer) == 400, (head, answer)
        assert b"Location" not in answer
    assert upstream.requests == []
    # A real client follows the redirect to the TLS listener and gets the upstream's answer.
    connector = aiohttp.TCPConnector(ssl=trusting(tls_files.ca))
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session,
        session.post(f"http://127.0.0.1:{plain}/p?k=v", data=b"body") as resp,
    ):
        assert resp.status == 200
        assert str(resp.url) == f"https://127.0.0.1:{secure}/p?k=v"
        assert [r.status for r in resp.history] == [308]
    (forwarded,) = upstream.requests
    assert (forwarded.method, forwarded.raw_path, forwarded.body) == ("POST", "/p?k=v", b"body")


async def test_a_redirect_to_a_named_port_and_status(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tls_files: TLSFiles
) -> None:
    """Behind a port mapping clients reach HTTPS on 443, which the Location then leaves out."""
    gw = await start_gateway(
        _redirect_policy(upstream.url, tls_files, "443\n      redirect_status: 307")
    )
    answer = await exchange(port_of(gw, 0), b"GET /x?y HTTP/1.1\r\nHost: a.example:80\r\n\r\n")
    assert (status_of(answer), _location(answer)) == (307, "https://a.example/x?y")


@pytest.fixture
def named(tmp_path: Path, tls_files: TLSFiles) -> dict[str, tuple[Path, Path]]:
    """Three certificates of the test CA: for a.test, for *.b.test, and a default one."""
    return {
        stem: make_named_certificate(tmp_path, tls_files, stem, names)
        for stem, names in (
            ("a", ("a.test",)),
            ("wild", ("*.b.test",)),
            ("fallback", ("fallback.test",)),
        )
    }


def _sni_policy(upstream_url: str, named: dict[str, tuple[Path, Path]]) -> str:
    (a_cert, a_key), (w_cert, w_key), (f_cert, f_key) = named["a"], named["wild"], named["fallback"]
    listeners = (
        "    - address: 127.0.0.1:0\n"
        "      tls:\n"
        "        certificates:\n"
        f"          - {{cert: {a_cert}, key: {a_key}, server_names: [a.test]}}\n"
        f"          - {{cert: {f_cert}, key: {f_key}, default: true}}\n"
        f"          - {{cert: {w_cert}, key: {w_key}, server_names: ['*.b.test']}}\n"
    )
    return listeners_policy(upstream_url, listeners)


async def test_sni_chooses_the_certificate_by_name_with_a_default(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tls_files: TLSFiles,
    named: dict[str, tuple[Path, Path]],
) -> None:
    gw = await start_gateway(_sni_policy(upstream.url, named))
    a, wild, fallback = (fingerprint(named[stem][0]) for stem in ("a", "wild", "fallback"))
    # Verified against the CA for the name asked: the certificate served is the name's.
    assert await served(gw.port, "a.test", tls_files.ca) == a
    assert await served(gw.port, "A.Test", tls_files.ca) == a
    assert await served(gw.port, "x.b.test", tls_files.ca) == wild
    assert await served(gw.port, "deep.x.b.test") == wild  # nginx's wildcard: any depth
    assert await served(gw.port, "b.test") == fallback
    assert await served(gw.port, "unknown.test") == fallback
    assert await served(gw.port, None) == fallback
    connector = aiohttp.TCPConnector(ssl=trusting(tls_files.ca))
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session,
        session.get(f"https://127.0.0.1:{gw.port}/", server_hostname="a.test") as resp,
    ):
        assert resp.status == 200


def test_an_exact_name_wins_over_a_wildcard_and_a_longer_wildcard_over_a_shorter() -> None:
    names = ServerNames(
        TlsSettings(
            certificates=(
                Certificate(cert="w.pem", key="w.key", server_names=("*.example.com",)),
                Certificate(cert="d.pem", key="d.key", default=True),
                Certificate(
                    cert="x.pem", key="x.key", server_names=("*.api.example.com", "api.example.com")
                ),
                Certificate(cert="e.pem", key="e.key", server_names=("a.api.example.com.",)),
            )
        )
    )
    assert names.index_for("a.api.example.com") == 3
    assert names.index_for("A.API.Example.com.") == 3
    assert names.index_for("b.api.example.com") == 2
    assert names.index_for("api.example.com") == 2
    assert names.index_for("www.example.com") == 0
    assert names.index_for("example.com") == 1
    assert names.index_for("notexample.com") == 1
    assert names.index_for(None) == 1


async def test_each_certificate_is_reloaded_on_its_own_when_its_files_change(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tls_files: TLSFiles,
    named: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw = await start_gateway(_sni_policy(upstream.url, named))
    caplog.set_level(logging.INFO, logger="gateway.tls")
    wild, fallback = fingerprint(named["wild"][0]), fingerprint(named["fallback"][0])
    renewed_dir = tmp_path / "renewed"
    renewed_dir.mkdir()
    renewed = make_named_certificate(renewed_dir, tls_files, "a", ("a.test",))
    for source, target in zip(reversed(renewed), reversed(named["a"]), strict=True):
        staged = target.with_name(target.name + ".new")
        staged.write_bytes(source.read_bytes())
        os.replace(staged, target)  # key first, then the certificate, each renamed in place

    async def a_renewed() -> bool:
        return await served(gw.port, "a.test", tls_files.ca) == fingerprint(renewed[0])

    await wait_until(a_renewed, "the renewed certificate for a.test served", within_s=10)
    assert await served(gw.port, "x.b.test", tls_files.ca) == wild
    assert await served(gw.port, None) == fallback
    # A key that is not its certificate's: refused in one line; that one's old pair stays.
    wild_key = named["wild"][1]
    staged = wild_key.with_name("wild.key.new")
    staged.write_bytes(named["fallback"][1].read_bytes())
    os.replace(staged, wild_key)

    def refused() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.ERROR]

    await wait_until(refused, "the mismatched key refused", within_s=10)
    (record,) = refused()
    assert f"{wild_key}: this key does not belong to {named['wild'][0]}" in record.getMessage()
    assert await served(gw.port, "x.b.test", tls_files.ca) == wild
    assert gw.gateway.tls is not None
    assert gw.gateway.tls.reloads == {"ok": 1, "failed": 1}


async def test_a_reload_renews_certificates_and_refuses_moved_listeners(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tls_files: TLSFiles,
    named: dict[str, tuple[Path, Path]],
) -> None:
    gw = await start_gateway(_sni_policy(upstream.url, named))
    swapped = dict(named, a=named["fallback"], fallback=named["a"])
    gw.gateway.apply(parse_and_build(_sni_policy(upstream.url, swapped)))
    assert await served(gw.port, None) == fingerprint(named["a"][0])
    # A listener added, or a certificate that does not load: the reload refused whole.
    running = gw.gateway.loaded
    more = _sni_policy(upstream.url, named).replace(
        "  listen:\n", "  listen:\n    - address: 127.0.0.1:0\n"
    )
    with pytest.raises(ValueError, match=r"server\.listen \(the listeners' addresses"):
        gw.gateway.apply(parse_and_build(more))
    missing = dict(named, wild=(named["wild"][0].with_name("gone.pem"), named["wild"][1]))
    with pytest.raises(ValueError, match=r"gone\.pem: cannot read"):
        gw.gateway.apply(parse_policy(_sni_policy(upstream.url, missing), "test.yaml"))
    assert gw.gateway.loaded is running
    assert await served(gw.port, None) == fingerprint(named["a"][0])


def _gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_check_and_run_refuse_a_missing_certificate_with_its_line(
    tmp_path: Path, named: dict[str, tuple[Path, Path]]
) -> None:
    policy = tmp_path / "policy.yaml"
    text = _sni_policy("http://127.0.0.1:9", named).replace(
        str(named["wild"][0]), "missing-wild.pem"
    )
    policy.write_text(text.replace("127.0.0.1:0", f"127.0.0.1:{free_port()}", 1))
    for command in (["check", str(policy)], ["run", "--config", str(policy)]):
        result = _gateway(*command)
        assert result.returncode != 0
        assert result.stderr.strip().splitlines() == [
            f"{policy}:9: server.listen[0].tls.certificates[2]: "
            f"{tmp_path / 'missing-wild.pem'}: cannot read: No such file or directory"
        ], command


def test_check_binds_every_listener_and_run_refuses_listen_over_a_list(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    listeners = "    - address: 127.0.0.1:0\n    - address: 192.0.2.1:8080\n"
    policy.write_text(listeners_policy("http://127.0.0.1:9", listeners))
    result = _gateway("check", str(policy), env={"GATEWAY_LISTEN": "127.0.0.1:8080"})
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"{policy}:5: server.listen[1].address: cannot listen on 192.0.2.1:8080: cannot assign "
        "requested address (no local interface has this address)"
    )
    result = _gateway("run", "--config", str(policy), "--listen", "127.0.0.1:0")
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "gateway: --listen: the policy's server.listen is a list of listeners: change their "
        "addresses there"
    )


async def test_every_worker_serves_every_listener_and_drains_them_on_sigterm(
    upstream: RecordingUpstream, gateway_process: StartGateway, tls_files: TLSFiles
) -> None:
    plain, secure, redirect = free_port(), free_port(), free_port()
    policy = (
        "server:\n  admin_listen: 127.0.0.1:{admin_port}\n  drain_delay: 3s\n  listen:\n"
        f"    - address: 127.0.0.1:{plain}\n"
        f"    - address: 127.0.0.1:{secure}\n"
        f"      tls: {{{{cert: {tls_files.server_cert}, key: {tls_files.server_key}}}}}\n"
        f"    - address: 127.0.0.1:{redirect}\n      redirect_to_https: true\n"
        f"upstreams:\n  backend:\n    url: {upstream.url}\n"
        "routes:\n  - name: all\n    upstream: backend\n"
    )
    # The image's GATEWAY_LISTEN does not replace a list of listeners: it is said, once a worker.
    gw = await gateway_process(
        "--workers", "2", policy=policy, env={"GATEWAY_LISTEN": "127.0.0.1:1"}
    )
    await wait_until(
        lambda: len([ln for ln in gw.log().splitlines() if "serving on" in ln]) == 2,
        "both workers serving",
        within_s=30,
    )
    started = [line for line in gw.log().splitlines() if "serving on" in line]
    for line in started:
        assert (
            f"serving on 127.0.0.1:{plain}, 127.0.0.1:{secure} over TLS (certificate "
            f"{tls_files.server_cert}, valid until " in line
        )
        assert f"127.0.0.1:{redirect} (redirects to https port {secure})" in line
    # Each worker says it just after its "serving on" line: the second may not be written yet.
    unused = "GATEWAY_LISTEN (127.0.0.1:1) is not used: the policy's server.listen"
    await wait_until(lambda: gw.log().count(unused) == 2, "both workers' GATEWAY_LISTEN line")
    connector = aiohttp.TCPConnector(ssl=trusting(tls_files.ca))
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:

        async def all_answer() -> None:
            for url in (f"http://127.0.0.1:{plain}/", f"https://127.0.0.1:{secure}/"):
                async with session.get(url) as resp:
                    assert resp.status == 200, url
            redirected = f"http://127.0.0.1:{redirect}/r?s=1"
            async with session.get(redirected, allow_redirects=False) as resp:
                assert resp.status == 301
                assert resp.headers["Location"] == f"https://127.0.0.1:{secure}/r?s=1"

        await all_answer()
        gw.proc.send_signal(signal.SIGTERM)

        # Draining: /readyz says 503 while every listener still serves.
        async def not_ready() -> bool:
            async with session.get(gw.admin_url + "/readyz") as resp:
                return resp.status == 503

        await wait_until(not_ready, "/readyz 503 while draining", within_s=5)
        await all_answer()
        assert await exit_code(gw, 30) == 0
        for port in (plain, secure, redirect):
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
