"""TLS on the client listener: real clients (curl, aiohttp) over TLS 1.2 and 1.3, certificates
rotated under load, bad pairs refused in one line, hostile bytes on the TLS port."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import ssl
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import parse_policy
from gateway.policy.models import TlsSettings
from gateway.policy.tls_files import certificate_not_after, load_tls
from tests.support.gateways import GatewayFactory
from tests.support.metrics import parse_metrics, value
from tests.support.network import TIMEOUT
from tests.support.policies import policy_for
from tests.support.pools import process_policy
from tests.support.processes import REPO_ROOT, StartGateway
from tests.support.upstreams import RecordingUpstream


@dataclass
class Pair:
    cert: Path
    key: Path

    @property
    def fingerprint(self) -> str:
        der = ssl.PEM_cert_to_DER_cert(self.cert.read_text())
        return hashlib.sha256(der).hexdigest()


def make_pair(directory: Path, name: str, days: int = 30) -> Pair:
    """A self-signed certificate for localhost (``days`` < 0: already expired)."""
    key, cert, csr = directory / f"{name}.key", directory / f"{name}.crt", directory / f"{name}.csr"
    subprocess.run(
        ["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "x509", "-req", "-in", str(csr), "-signkey", str(key), "-days", str(days),
         "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return Pair(cert, key)


def tls_policy(upstream: str, pair: Pair, extra: str = "") -> str:
    return policy_for(
        upstream, server=f"  tls:\n    cert: {pair.cert}\n    key: {pair.key}\n" + extra
    )


def client_context(version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if version is not None:
        context.minimum_version = context.maximum_version = version
    return context


async def served_certificate(port: int) -> tuple[str, str | None, str | None]:
    """A new handshake's certificate (sha256 of its DER), TLS version and ALPN protocol."""
    context = client_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True)
    version, alpn = ssl_object.version(), ssl_object.selected_alpn_protocol()
    writer.close()
    return hashlib.sha256(der).hexdigest(), version, alpn


def replace_pair(current: Pair, new: Pair) -> None:
    """Rotate as a deployment does: each file replaced whole by a rename."""
    for source, target in ((new.key, current.key), (new.cert, current.cert)):
        tmp = target.with_name(target.name + ".new")
        tmp.write_bytes(source.read_bytes())
        os.replace(tmp, target)


@pytest.fixture
def pair(tmp_path: Path) -> Pair:
    return make_pair(tmp_path, "localhost")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_aiohttp_and_curl_over_tls_1_2_and_1_3_with_forwarded_proto(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, pair: Pair, version: ssl.TLSVersion
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair))
    url = f"https://127.0.0.1:{gw.port}/x"
    connector = aiohttp.TCPConnector(ssl=client_context(version))
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        for _ in range(3):  # on one kept-alive connection
            async with session.get(url) as resp:
                assert resp.status == 200
                assert await resp.text() == "ok GET /x"
    flag = "--tlsv1.2" if version is ssl.TLSVersion.TLSv1_2 else "--tlsv1.3"
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sk", flag, "--tls-max", flag.removeprefix("--tlsv"), "-w", "%{http_code}",
        "-o", "/dev/null", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        out, err = await curl.communicate()
    assert out == b"200", err
    assert len(upstream.requests) == 4
    for recorded in upstream.requests:
        assert (b"X-Forwarded-Proto", b"https") in recorded.raw_headers
    fingerprint, negotiated, alpn = await served_certificate(gw.port)
    assert fingerprint == pair.fingerprint
    assert negotiated == "TLSv1.3" and alpn == "http/1.1"


async def test_min_version_1_3_refuses_a_tls_1_2_client(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, pair: Pair
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair, "    min_version: 1.3\n"))
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        await asyncio.open_connection(
            "127.0.0.1", gw.port, ssl=client_context(ssl.TLSVersion.TLSv1_2)
        )
    _, negotiated, _ = await served_certificate(gw.port)
    assert negotiated == "TLSv1.3"
    assert upstream.requests == []


async def test_a_certificate_rotated_under_load_fails_no_request(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, pair: Pair, tmp_path: Path
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair))
    rotated = make_pair(tmp_path, "rotated", days=60)
    url = f"https://127.0.0.1:{gw.port}/"
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client(new_connections: bool) -> None:
        connector = aiohttp.TCPConnector(ssl=client_context(), force_close=new_connections)
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
            while not stop.is_set():
                try:
                    async with session.get(url) as resp:
                        await resp.read()
                        outcomes[str(resp.status)] += 1
                except aiohttp.ClientError as exc:
                    outcomes[type(exc).__name__] += 1

    clients = [asyncio.ensure_future(client(n % 2 == 0)) for n in range(6)]
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 15
        while outcomes.total() < 20:  # some answered under the first certificate
            assert loop.time() < deadline, outcomes
            await asyncio.sleep(0.05)
        replace_pair(pair, rotated)
        while (await served_certificate(gw.port))[0] != rotated.fingerprint:
            assert loop.time() < deadline, "the new certificate was not served"
            await asyncio.sleep(0.05)
        rotated_at = outcomes.total()
        while outcomes.total() < rotated_at + 20:  # and some under the new one
            assert loop.time() < deadline, outcomes
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        async with asyncio.timeout(15):
            await asyncio.gather(*clients)
    assert set(outcomes) == {"200"}, outcomes
    metrics_url = gw.admin_url + "/metrics"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.get(metrics_url) as resp:
        samples = parse_metrics(await resp.text())
    assert value(samples, "gateway_tls_certificate_reloads_total", result="ok") == 1
    expiry = certificate_not_after(ssl.PEM_cert_to_DER_cert(rotated.cert.read_text()))
    assert value(samples, "gateway_tls_certificate_expiry_timestamp_seconds") == expiry


@pytest.mark.parametrize("problem", ["mismatched key", "expired"])
async def test_a_bad_new_pair_is_refused_in_one_line_and_the_old_one_stays(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    pair: Pair,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    problem: str,
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair))
    other = make_pair(tmp_path, "other", days=-1 if problem == "expired" else 30)
    caplog.set_level(logging.INFO, logger="gateway.tls")
    original = pair.fingerprint
    if problem == "mismatched key":
        replace_pair(pair, Pair(pair.cert, other.key))
        expected = f"{pair.key}: this key does not belong to {pair.cert}"
    else:
        replace_pair(pair, other)
        expected = f"{pair.cert}: the certificate expired on "
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not [r for r in caplog.records if r.name == "gateway.tls"]:
        assert loop.time() < deadline, "no reload attempt"
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.5)  # another poll or two: the refused files are not read again
    records = [r for r in caplog.records if r.name == "gateway.tls"]
    assert len(records) == 1
    (record,) = records
    assert record.levelno == logging.ERROR and record.exc_info is None
    message = record.getMessage()
    assert "\n" not in message and expected in message
    assert message.startswith("TLS certificate not reloaded, the one in use stays: ")
    # The pair loaded at start still serves.
    assert (await served_certificate(gw.port))[0] == original
    connector = aiohttp.TCPConnector(ssl=client_context())
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        async with session.get(f"https://127.0.0.1:{gw.port}/") as resp:
            assert resp.status == 200
        async with session.get(gw.admin_url + "/metrics") as resp:
            samples = parse_metrics(await resp.text())
    assert value(samples, "gateway_tls_certificate_reloads_total", result="failed") == 1


async def test_hostile_bytes_on_the_tls_port_close_the_connection_cleanly(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    pair: Pair,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair, "  header_timeout: 1s\n"))
    caplog.set_level(logging.DEBUG)

    async def closed_after(data: bytes, within_s: float, then_wait: bool = False) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(data)
        if not then_wait:
            writer.write_eof()
        async with asyncio.timeout(within_s):
            answer = await reader.read()  # b"" or an alert, then EOF: closed by the gateway
        writer.close()
        return answer

    # Plain HTTP to the TLS port: no HTTP answer, the connection closed.
    answer = await closed_after(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 5, then_wait=True)
    assert not answer.startswith(b"HTTP/")
    # A handshake cut short (the first bytes of a real ClientHello), and one that stalls: the
    # gateway closes it within header_timeout (1 s here) rather than asyncio's minute.
    hello = _client_hello()
    await closed_after(hello[:40], 5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await closed_after(hello[:40], 5, then_wait=True)
    assert loop.time() - started < 3
    await closed_after(os.urandom(300), 5)
    # Still serving, and nothing above was logged as an error.
    _, version, _ = await served_certificate(gw.port)
    assert version == "TLSv1.3"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert upstream.requests == []


def _client_hello() -> bytes:
    """The bytes a TLS client sends first."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = client_context().wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_an_expired_certificate_stops_check_and_run_with_one_line(tmp_path: Path) -> None:
    expired = make_pair(tmp_path, "old", days=-1)
    policy = tmp_path / "policy.yaml"
    policy.write_text(tls_policy("http://127.0.0.1:9", expired))
    for command in (["check", str(policy)], ["run", "--config", str(policy)]):
        result = subprocess.run(
            [sys.executable, "-m", "gateway", *command],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert f"{expired.cert}: the certificate expired on " in lines[0]
        assert "server.tls" in lines[0]


def test_relative_names_are_read_beside_the_policy_file(tmp_path: Path) -> None:
    made = make_pair(tmp_path, "beside")
    (loaded,) = load_tls(
        TlsSettings(cert="beside.crt", key="beside.key"), str(tmp_path / "policy.yaml")
    )
    assert loaded.cert == made.cert
    assert loaded.not_after == certificate_not_after(
        ssl.PEM_cert_to_DER_cert(made.cert.read_text())
    )


async def test_a_policy_reload_naming_new_files_swaps_the_certificate_or_is_refused_whole(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, pair: Pair, tmp_path: Path
) -> None:
    gw = await start_gateway(tls_policy(upstream.url, pair))
    fresh = make_pair(tmp_path, "fresh")
    gw.gateway.apply(parse_and_build(tls_policy(upstream.url, fresh)))
    assert (await served_certificate(gw.port))[0] == fresh.fingerprint
    # Files that do not load: the reload is refused and the policy and certificate stay.
    missing = Pair(tmp_path / "absent.crt", tmp_path / "absent.key")
    running = gw.gateway.loaded
    with pytest.raises(ValueError, match=r"absent\.crt: cannot read"):
        gw.gateway.apply(parse_policy(tls_policy(upstream.url, missing), "test.yaml"))
    assert gw.gateway.loaded is running
    assert (await served_certificate(gw.port))[0] == fresh.fingerprint
    # And TLS cannot be turned off (or on) by a reload: the listener is bound.
    with pytest.raises(ValueError, match="restart"):
        gw.gateway.apply(parse_and_build(policy_for(upstream.url)))


async def test_sighup_reads_the_certificate_again(
    tmp_path: Path, upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    """The files are rewritten in place with their size and times kept, so that only the
    signal, not the file watcher, can be what loads the new pair."""
    first = make_pair(tmp_path, "first")
    size = first.cert.stat().st_size
    for attempt in range(20):  # an ECDSA signature's length varies: find a pair of equal size
        second = make_pair(tmp_path, f"second{attempt}")
        if (
            second.cert.stat().st_size == size
            and second.key.stat().st_size == first.key.stat().st_size
        ):
            break
    else:
        pytest.fail("no certificate of the same size came out of 20 tries")
    policy = tls_policy(upstream.url, first).split("upstreams:", 1)
    body = policy[0].split("  admin_listen: 127.0.0.1:0\n", 1)[1] + "upstreams:" + policy[1]
    original = first.fingerprint
    gw = await gateway_process(policy=process_policy(body))
    assert (await served_certificate(gw.port))[0] == original
    # The start line says the port speaks TLS (a plain-HTTP client gets no answer there).
    (start,) = [line for line in gw.log().splitlines() if "serving on" in line]
    assert f"serving on 127.0.0.1:{gw.port} over TLS (certificate {first.cert}, valid" in start
    for source, target in ((second.cert, first.cert), (second.key, first.key)):
        before = target.stat()
        with target.open("r+b") as file:
            file.write(source.read_bytes())
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    await asyncio.sleep(2.5)  # the watcher's polls see nothing new
    assert (await served_certificate(gw.port))[0] == original
    gw.proc.send_signal(signal.SIGHUP)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await served_certificate(gw.port))[0] != second.fingerprint:
        assert loop.time() < deadline, "SIGHUP did not load the new pair"
        await asyncio.sleep(0.1)
