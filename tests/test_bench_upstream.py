"""The benchmarks' nginx upstream answers exactly as bench/upstream.py does, and its CPU is
counted over both of its processes (bench/bench_proxy.py, ``--upstream-impl nginx``)."""

from __future__ import annotations

import http.client
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nginx_harness import nginx_available

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import bench_proxy as bp
from upstream import BODY

needs_nginx = pytest.mark.skipif(not nginx_available(), reason="needs the nginx Debian package")


def test_nginx_string_writes_the_body_and_refuses_what_nginx_would_rewrite() -> None:
    assert bp.nginx_string(b"ab\n") == '"ab\\n"'
    assert bp.nginx_string(BODY) == '"' + "x" * 99 + '\\n"'
    for body in (b"$host", b'say "hi"', b"back\\slash", b"tab\there", "é".encode()):
        with pytest.raises(ValueError):
            bp.nginx_string(body)


@pytest.fixture
def nginx_upstream(tmp_path: Path) -> Iterator[tuple[bp.RunningTarget, int]]:
    procs = bp.Processes(tmp_path)
    harness = bp.Harness(procs, tmp_path, bp.CpuPlan(), bp.NGINX_UPSTREAM)
    try:
        target = bp.start_with_retries(harness.start_upstream)
        yield target, harness.upstream_port
    finally:
        procs.stop_all()


@needs_nginx
def test_nginx_upstream_answers_like_the_python_one_and_keeps_the_connection(
    nginx_upstream: tuple[bp.RunningTarget, int],
) -> None:
    _, port = nginx_upstream
    conn = http.client.HTTPConnection(bp.HOST, port, timeout=5)
    try:
        # Past nginx's default keepalive_requests (1,000): the Python upstream never closes.
        for path in ("/", "/bench?ready=1", "/page.html", *["/"] * 1_100):
            conn.request("GET", path)
            response = conn.getresponse()
            assert response.status == 200
            assert response.read() == BODY
            assert response.getheader("Content-Type") == "text/plain"
            assert response.getheader("Content-Length") == "100"
            assert not response.will_close
    finally:
        conn.close()


@needs_nginx
def test_nginx_upstream_cpu_counts_its_master_and_worker(
    nginx_upstream: tuple[bp.RunningTarget, int],
) -> None:
    target, _ = nginx_upstream
    _, processes = bp.process_group_cpu(target.started.proc.pid)
    assert processes == 2
