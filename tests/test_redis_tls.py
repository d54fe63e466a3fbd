"""``rediss://``: a real Redis speaking TLS, with a throwaway CA made by openssl for the test.

The store must verify the server against a CA the operator names (``?ssl_ca_certs=FILE`` in the
URL, the parameter redis-py reads too), and must refuse a server its trust store cannot verify.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import aiohttp
import pytest
import redis

from gateway.clock import FakeClock
from gateway.stores.redis import RedisStore
from gateway.stores.redis.circuit import CircuitBreaker
from tests.support import redis_harness
from tests.support.conformance import T0_US
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisFactory, free_port
from tests.support.upstreams import RecordingUpstream

pytestmark = pytest.mark.reliability

redis_factory = redis_harness.redis_factory

LIMITS = """\
limits:
  per_ip:
    algorithm: fixed_window
    limit: 3
    window: 1m
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_files(tmp_path: Path) -> Path:
    """A CA, and a server certificate it signed for 127.0.0.1 (the URL's host)."""
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test CA",
        "-keyout", "ca.key", "-out", "ca.pem", cwd=tmp_path,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr", cwd=tmp_path,
    )  # fmt: skip
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "server.pem",
        cwd=tmp_path,
    )  # fmt: skip
    return tmp_path


def _tls_redis(factory: RedisFactory, files: Path) -> tuple[int, int]:
    """A Redis with a plain port (for the harness and for looking at keys) and a TLS port."""
    tls_port = free_port()
    server = factory.start(
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(files / "server.pem"),
        "--tls-key-file", str(files / "server.key"),
        "--tls-ca-cert-file", str(files / "ca.pem"),
        "--tls-auth-clients", "no",
    )  # fmt: skip
    return server.port, tls_port


@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_rediss_verified_against_the_configured_ca(
    client: str,
    tls_files: Path,
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
) -> None:
    plain_port, tls_port = _tls_redis(redis_factory, tls_files)
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tls_files / 'ca.pem'}"
    # A TLS handshake can take longer than the 50 ms default deadline on a loaded machine.
    # The scripts decide on a fake clock, not on Redis TIME: a minute's end could fall
    # between the four requests, and the fourth be admitted in a new window.
    clock = FakeClock(T0_US)
    store = RedisStore(
        url,
        client=client,  # type: ignore[arg-type]
        key_prefix="tls:",
        timeout_s=2.0,
        clock=clock,
        time_source=clock,
    )
    gw = await start_gateway(policy_for(upstream.url, LIMITS), clock=clock, store=store)
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(4):
            async with session.get(gw.url + "/") as response:
                statuses.append(response.status)
    assert statuses == [200, 200, 200, 429]
    assert store.counters.calls == 4 and store.counters.failed_calls == 0
    with redis.Redis(host="127.0.0.1", port=plain_port) as plain:
        assert plain.keys("tls:*"), "the decisions were not made in Redis"


@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_rediss_refuses_a_server_it_cannot_verify(
    client: str,
    tls_files: Path,
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
) -> None:
    """Without the CA the certificate does not verify: no call succeeds (deny mode: 503)."""
    _, tls_port = _tls_redis(redis_factory, tls_files)
    store = RedisStore(
        f"rediss://127.0.0.1:{tls_port}",
        client=client,  # type: ignore[arg-type]
        timeout_s=2.0,
        on_failure="deny",
        breaker=CircuitBreaker(
            "tls", failure_threshold=1, reset_timeout_s=60, max_reset_timeout_s=60
        ),
    )
    gw = await start_gateway(policy_for(upstream.url, LIMITS), store=store)
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/") as response:
        assert response.status == 503
    assert store.counters.failed_calls >= 1 and store.counters.denied_closed >= 1
    assert upstream.requests == []
