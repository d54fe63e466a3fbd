"""``gateway replay``: logs read as requests and decided by the live engine on a simulated clock.

The live gateway's own access log, replayed, gives the same decision for every request; nginx
``combined`` and JSON-lines logs with known bursts give counts computed by hand from nginx's
``limit_req`` arithmetic; bad lines, empty, gzipped and piped logs; the HTML report in a real
headless Chromium (the screenshot kept in ``$GATEWAY_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import itertools
import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from playwright.async_api import Browser

from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build, parse_and_build
from gateway.log_setup import GatewayFormatter, LogFormat
from gateway.replay import replay
from gateway.replay.log_formats import (
    Opened,
    ReadStats,
    Request,
    close_log,
    in_time_order,
    open_log,
    read_log,
)
from gateway.replay.run import Progress
from gateway.replay.simulate import ALLOWED, DENIED, REJECTED, UNROUTED, Simulation
from tests.support.browser import artifacts_dir
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.rawhttp import exchange, status_of
from tests.support.upstreams import RecordedRequest, RecordingUpstream

ROOT = Path(__file__).resolve().parent.parent
START = 1_700_000_000  # 2023-11-14T22:13:20Z


def stamp(second: int) -> str:
    return datetime.fromtimestamp(START + second, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")


def combined(ip: str, second: int, method: str = "GET", path: str = "/", extra: str = "") -> str:
    return f'{ip} - - [{stamp(second)}] "{method} {path} HTTP/1.1" 200 12 "-" "curl/8.5"{extra}\n'


def write_policy(tmp_path: Path, limits: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(policy_for("http://127.0.0.1:9") + "limits:\n" + limits)
    return path


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", "--json", *args]) == 0
    out = capsys.readouterr().out
    doc: dict[str, Any] = json.loads(out)
    return doc


def limit_of(doc: dict[str, Any], name: str, policy: int = 0) -> dict[str, Any]:
    return next(lim for lim in doc["policies"][policy]["limits"] if lim["name"] == name)


# rate 1r/s, burst 2: nginx's excess in milli-requests is max(0, excess - 1000 * ms / 1000 + 1000)
# and a request whose excess would pass burst * 1000 = 2000 is rejected.
NGINX_NODELAY = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n    nodelay: true\n"
)


def burst_log(tmp_path: Path) -> Path:
    """203.0.113.1: four requests logged in second 0 (spread to 0, 250, 500, 750 ms), two in
    second 5 (5000, 5500 ms). 203.0.113.2: one request a second, never limited."""
    lines = [combined("203.0.113.1", 0) for _ in range(4)]
    lines += [combined("203.0.113.2", s) for s in range(1, 5)]
    lines += [combined("203.0.113.1", 5) for _ in range(2)]
    log = tmp_path / "access.log"
    log.write_text("".join(lines))
    return log


def test_combined_log_counts_match_nginx_arithmetic_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0 ms: new key, excess 0, admitted. 250: 0 - 250 + 1000 = 750, admitted. 500: 750 - 250 +
    # 1000 = 1500, admitted. 750: 1500 - 250 + 1000 = 2250 > 2000, rejected (charged nothing).
    # 5000: 1500 - 4500 + 1000 < 0 -> 0, admitted. 5500: 0 - 500 + 1000 = 500, admitted.
    policy = write_policy(tmp_path, NGINX_NODELAY)
    doc = replay_json(capsys, "--config", str(policy), str(burst_log(tmp_path)))
    per_ip = limit_of(doc, "per_ip")
    assert (per_ip["allowed"], per_ip["delayed"], per_ip["rejected"]) == (9, 0, 1)
    assert per_ip["top_rejected_keys"] == [{"key": "203.0.113.1", "requests": 1}]
    assert doc["policies"][0]["rejected_by"] == {"per_ip": 1}
    assert doc["logs"] == [{"file": str(tmp_path / "access.log"), "format": "combined"}]
    assert any("spread evenly" in note for note in doc["notes"])
    assert doc["requests"] == 10 and doc["malformed"]["count"] == 0


def test_combined_log_delays_and_queue_bound_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same traffic without nodelay: every excess request waits excess / rate.
    # 250 ms: excess 750 -> waits 750 ms (until 1000). 500: 1500 -> waits 1500 ms (until 2000).
    # 750: 2250 > 2000, rejected. Two waiting at once: the peak queue is 2.
    shaping = "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n"
    policy = write_policy(tmp_path, shaping)
    doc = replay_json(capsys, "--config", str(policy), str(burst_log(tmp_path)))
    per_ip = limit_of(doc, "per_ip")
    # 5000: 0 -> admitted at once; 5500: 500 -> waits 500 ms.
    assert (per_ip["allowed"], per_ip["delayed"], per_ip["rejected"]) == (6, 3, 1)
    assert per_ip["delay_ms"] == {"p50": 750.0, "p90": 1500.0, "p99": 1500.0, "max": 1500.0}
    assert per_ip["peak_queue"] == 2
    assert doc["policies"][0]["delayed_by"] == {"per_ip": 3}

    # max_queue: 1. 500 ms: one waits (until 1000 ms): the queue is full, rejected at once and
    # charged nothing (excess stays 750). 750: 750 - 500 + 1000 = 1250, would wait 1250 ms, but
    # the queue is still full: rejected. 5000: admitted; 5500: waits 500 ms (the first left at
    # 1000 ms).
    bounded = shaping + "    max_queue: 1\n"
    policy = write_policy(tmp_path, bounded, "bounded.yaml")
    doc = replay_json(capsys, "--config", str(policy), str(burst_log(tmp_path)))
    per_ip = limit_of(doc, "per_ip")
    assert (per_ip["allowed"], per_ip["delayed"], per_ip["rejected"]) == (6, 2, 2)
    assert per_ip["peak_queue"] == 1


def test_msec_and_request_time_fields_give_the_instant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # $msec is when the request ended; $request_time how long it took: it arrived at the
    # difference. Two requests 600 ms apart arrive 100 ms apart: the second is rejected under
    # 1r/s burst 0 (excess 900 > 0), though nginx logged them 600 ms apart.
    limits = "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 0\n"
    policy = write_policy(tmp_path, limits)
    log = tmp_path / "timed.log"
    log.write_text(
        combined("198.51.100.7", 0, extra=f' "-" {START}.100 0.000')
        + combined("198.51.100.7", 0, extra=f' "-" {START}.700 0.500')
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert limit_of(doc, "per_ip")["rejected"] == 1
    assert not any("spread evenly" in note for note in doc["notes"])
    # Without $request_time they are 600 ms apart: excess 1000 - 600 = 400 > 0, still rejected;
    # 1.2 s apart, both admitted.
    log.write_text(
        combined("198.51.100.7", 0, extra=f" {START}.100")
        + combined("198.51.100.7", 1, extra=f" {START + 1}.300")
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert limit_of(doc, "per_ip")["rejected"] == 0


def test_forwarded_for_field_keys_the_client_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY.replace("burst: 2", "burst: 0"))
    log = tmp_path / "xff.log"
    # One load balancer address; three clients behind it, one request each at the same second.
    log.write_text(
        "".join(
            combined("10.0.0.1", 0, extra=f' "{client}, 10.0.0.1"')
            for client in ("192.0.2.1", "192.0.2.2", "192.0.2.3")
        )
    )
    by_address = replay_json(capsys, "--config", str(policy), str(log))
    assert limit_of(by_address, "per_ip")["rejected"] == 2  # all keyed on 10.0.0.1
    by_client = replay_json(capsys, "--config", str(policy), "--forwarded-for", str(log))
    # The right-most entry (10.0.0.1, in the place of a trusted peer) is not trusted by the
    # policy, so it is the client, as the gateway would resolve it.
    assert limit_of(by_client, "per_ip")["rejected"] == 2
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text(
        policy.read_text().replace("server:\n", "server:\n  trusted_proxies: [10.0.0.0/8]\n")
    )
    by_client = replay_json(capsys, "--config", str(trusted), "--forwarded-for", str(log))
    assert limit_of(by_client, "per_ip")["rejected"] == 0


def test_json_lines_with_bursts_headers_and_hosts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # fixed_window 3 per second per API key: 5 requests of key "a" in one second -> 2 rejected;
    # key "b" sends 3 -> none; requests without the header skip the limit (on_missing_key skip).
    limits = (
        "  per_key:\n    algorithm: fixed_window\n    limit: 3\n    window: 1s\n"
        "    key: ['header:X-API-Key']\n"
        "  example:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n"
        "    key: [global]\n    match: {host: api.example.com}\n"
    )
    policy = write_policy(tmp_path, limits)
    records = []
    for i in range(5):
        records.append(
            {
                "ts": START + 0.1 * i,
                "ip": "192.0.2.9",
                "method": "GET",
                "path": "/x",
                "headers": {"X-API-Key": "a"},
            }
        )
    for i in range(3):
        records.append(
            {
                "ts": f"2023-11-14T22:13:20.{5 + i}Z",
                "ip": "192.0.2.9",
                "method": "GET",
                "path": "/x",
                "headers": {"x-api-key": "b"},
            }
        )
    for _ in range(2):  # the host limit: the second is rejected
        records.append(
            {
                "ts": START + 0.9,
                "ip": "192.0.2.9",
                "method": "GET",
                "path": "/",
                "headers": {"Host": "api.example.com:443"},
            }
        )
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert doc["logs"][0]["format"] == "jsonl"
    per_key = limit_of(doc, "per_key")
    assert (per_key["allowed"], per_key["rejected"]) == (6, 2)
    assert per_key["top_rejected_keys"] == [{"key": "a", "requests": 2}]
    assert limit_of(doc, "example")["rejected"] == 1
    assert doc["policies"][0]["outcomes"]["unlimited"] == 0


def test_top_keys_name_the_shared_bucket_and_a_client_ip_stand_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keys read as the limit log and the dashboard show them: ``unlisted: shared``'s one
    bucket, and the client IP standing in for a missing header, in words."""
    limits = (
        "  per_key:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n"
        "    key: ['header:X-API-Key']\n    overrides: {gold: {limit: 100}}\n"
        "    unlisted: shared\n"
        "  per_anon:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n"
        "    key: ['header:X-Other', route]\n    on_missing_key: client_ip\n"
    )
    policy = write_policy(tmp_path, limits)
    records = [
        {"ts": START + i, "ip": "192.0.2.9", "method": "GET", "path": "/", "headers": headers}
        for i, headers in enumerate([{"X-API-Key": f"made-up-{n}"} for n in range(3)])
    ]
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert limit_of(doc, "per_key")["top_rejected_keys"] == [
        {"key": "(unlisted keys, shared)", "requests": 2}
    ]
    assert limit_of(doc, "per_anon")["top_rejected_keys"] == [
        {"key": "192.0.2.9 (no key: client IP) · all", "requests": 2}
    ]


def test_malformed_truncated_and_empty_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY)
    log = tmp_path / "bad.log"
    good = combined("203.0.113.1", 0)
    log.write_text(
        good
        + "this is not a log line\n"
        + good.replace("[", "[99/Foo/2023:")  # a bad time
        + '203.0.113.1 - - [14/Nov/2023:22:13:20 +0000] "\\x16\\x03\\x01" 400 0 "-" "-"\n'
        + "\n"
        + good
        + good[:30]  # cut off mid-line, no newline
    )
    assert main(["replay", "--config", str(policy), str(log)]) == 0
    out = capsys.readouterr().out
    assert "malformed lines: 4" in out
    assert f"{log}:2: not an nginx combined log line" in out
    assert f"{log}:3: " in out and f"{log}:4: request line" in out
    assert f"{log}:7: not an nginx combined log line" in out
    assert "2 requests" in out

    empty = tmp_path / "empty.log"
    empty.write_text("")
    doc = replay_json(capsys, "--config", str(policy), str(empty))
    assert doc["requests"] == 0 and doc["lines"] == 0
    assert limit_of(doc, "per_ip")["allowed"] == 0

    unknown = tmp_path / "unknown.log"
    unknown.write_text("hello\n")
    assert main(["replay", "--config", str(policy), str(unknown)]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"gateway replay: {unknown}: line 1: cannot tell the log format "
        "(use --format combined|gateway|jsonl)\n"
    )
    assert main(["replay", "--config", str(policy), str(tmp_path / "missing.log")]) == 1
    assert "missing.log: cannot open" in capsys.readouterr().err


def test_gzipped_log_and_a_truncated_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY)
    plain = burst_log(tmp_path)
    packed = tmp_path / "access.log.1.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    doc = replay_json(capsys, "--config", str(policy), str(packed))
    assert limit_of(doc, "per_ip")["rejected"] == 1 and doc["requests"] == 10
    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(packed.read_bytes()[:-12])  # the trailer (CRC, size) missing
    doc = replay_json(capsys, "--config", str(policy), str(cut))
    assert any("compressed data ends early" in note for note in doc["notes"])


def test_stdin_and_exit_status_on_a_bad_policy(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY)
    log = burst_log(tmp_path).read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", "--json", "--config", str(policy), "-"],
        input=gzip.compress(log),
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""  # no progress bar when stderr is not a terminal
    doc = json.loads(done.stdout)
    assert doc["logs"] == [{"file": "<stdin>", "format": "combined"}]
    assert limit_of(doc, "per_ip")["rejected"] == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits: [not, a, mapping]\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", "--config", str(bad), "-"],
        input=log,
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(b"gateway replay: invalid policy:\n")
    assert b"Traceback" not in done.stderr


def test_compare_lists_clients_whose_outcome_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    current = write_policy(tmp_path, NGINX_NODELAY, "current.yaml")
    candidate = write_policy(tmp_path, NGINX_NODELAY.replace("burst: 2", "burst: 0"), "cand.yaml")
    doc = replay_json(
        capsys, "--config", str(candidate), "--compare", str(current), str(burst_log(tmp_path))
    )
    assert [p["label"] for p in doc["policies"]] == ["candidate", "current"]
    # burst 0: only requests a full second apart pass. 203.0.113.1 at 0 ms passes and 250, 500
    # and 750 fail; 5000 passes, 5500 fails: 4 rejected, 1 of them rejected under burst 2 too.
    assert limit_of(doc, "per_ip", 0)["rejected"] == 4
    assert limit_of(doc, "per_ip", 1)["rejected"] == 1
    compare = doc["compare"]
    assert compare["newly_rejected"] == [{"client": "203.0.113.1", "requests": 3}]
    assert compare["newly_admitted"] == []


# -- the live gateway and its replay agree ------------------------------------------------------

AGREEMENT_LIMITS = (
    # 2r/s, burst 3, the first excess request at once: per client per round, two admitted at
    # once, the next waits ~500 ms, the next ~1 s, the rest are over the burst. max_queue 3 for
    # all clients together: the queue fills. Rounds 1.6 s apart, so every queued request has
    # left long before the next round (the loop's timer and the simulated one agree).
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 2r/s\n    burst: 3\n    delay: 1\n"
    "    max_queue: 3\n    max_delay: 1s\n"
    "  api:\n    algorithm: sliding_window\n    limit: 7\n    window: 10s\n"
    "    match: {path_prefix: /api/}\n"
    "  global:\n    algorithm: token_bucket\n    rate: 20r/s\n    burst: 14\n    key: [global]\n"
)


def _live_result(line: dict[str, Any]) -> tuple[str, str | None, float]:
    return line["limit"], line["limit_name"], float(line["delay_ms"])


@pytest.mark.serial  # its traffic must be decided as sent: runs alone (scripts/test.sh)
async def test_replay_of_the_gateways_own_log_gives_every_request_the_same_decision(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    policy_text = (
        policy_for(
            upstream.url,
            server="  access_log: true\n  access_log_format: json\n"
            "  trusted_proxies: [127.0.0.0/8]\n",
        )
        + "limits:\n"
        + AGREEMENT_LIMITS
    )
    gw = await start_gateway(policy_text)  # the real clock
    clients = ["198.51.100.1", "198.51.100.2", "198.51.100.3"]
    sent = 0
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=10)
        ) as session:

            async def send(client: str, path: str) -> int:
                async with session.get(gw.url + path, headers={"X-Forwarded-For": client}) as resp:
                    await resp.read()
                    return resp.status

            for round_ in range(3):
                started = asyncio.get_running_loop().time()
                batch = [
                    send(client, f"/api/{round_}/{i}" if i % 2 else f"/page/{i}?q={i}")
                    for i in range(6)
                    for client in clients
                ]
                statuses = await asyncio.gather(*batch)
                sent += len(batch)
                assert set(statuses) <= {200, 429}
                await asyncio.sleep(max(0.0, started + 1.6 - asyncio.get_running_loop().time()))
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert len(lines) == sent
    log = tmp_path / "gateway-access.log"
    log.write_text("\n".join(lines) + "\n")
    live = {number: json.loads(text) for number, text in enumerate(lines, 1)}
    results = {_live_result(line)[0] for line in live.values()}
    assert {"allowed", "delayed", "rejected"} <= results  # the trace exercises all three
    assert any(
        line["limit"] == "rejected" and line["limit_name"] == "per_ip" for line in live.values()
    )

    simulation = Simulation(parse_and_build(policy_text, "test.yaml"))
    stats = ReadStats()
    opened = open_log(str(log))
    replayed = 0
    try:
        for request in in_time_order(read_log(opened, "auto", stats), 30_000_000, stats):
            simulation.decide(request, simulation.client_ip(request))
            outcome = simulation.last
            if outcome is None:
                got: tuple[str, str | None, float] = ("none", None, 0.0)
            elif outcome.status:
                got = ("rejected", outcome.rejected_by, 0.0)
            elif outcome.delay_s > 0.0:
                got = ("delayed", None, round(outcome.delay_s * 1000, 3))
            else:
                got = ("allowed", None, 0.0)
            assert got == _live_result(live[request.line]), (request, live[request.line])
            replayed += 1
    finally:
        close_log(opened)
    assert stats.formats == {str(log): "gateway"} and stats.malformed == 0 and stats.late == 0
    assert replayed == sent
    # And the figures of the command agree with the gateway's own counters.
    assert gw.gateway.handler is not None
    run = await replay([str(log)], [Simulation(parse_and_build(policy_text, "test.yaml"))])
    replay_counters = run.simulations[0].counters()
    for limit in gw.gateway.handler.runtime.engine.limits:
        c = limit.counters
        assert replay_counters[limit.name] == {
            "allowed": c.allowed,
            "delayed": c.delayed,
            "rejected": c.rejected,
            "dry_run_delayed": 0,
            "dry_run_rejected": 0,
        }


# Absolute-form targets (RFC 9112 3.2.2): the proxy forwards the origin-form part when the
# authority is the Host header's and answers 400 otherwise; replay must decide them alike.
ABSOLUTE_FORM = (
    ("http://example.test/api/a", "example.test"),
    ("http://EXAMPLE.test/api/b?x=1", "example.test"),
    ("http://example.test", "example.test"),  # no path: "/", which no route takes
    ("http://other.test/api/c", "example.test"),  # disagrees with Host
    ("http://user@example.test/api/d", "example.test"),  # userinfo
    ("example.test/api/e", "example.test"),  # neither origin- nor absolute-form
    ("/api/f", "example.test"),
)
_LIVE = {200: ALLOWED, 429: REJECTED, 400: DENIED, 404: UNROUTED}


async def test_replay_and_the_proxy_agree_on_absolute_form_targets(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy_text = (
        policy_for(upstream.url).replace(
            "  - name: all\n",
            "  - name: api\n    match: {host: example.test, path_prefix: /api/}\n",
        )
        + "limits:\n  per_ip:\n    algorithm: fixed_window\n    limit: 3\n    window: 1h\n"
        "    key: [client_ip]\n"
    )
    gw = await start_gateway(policy_text)
    live = []
    for target, host in ABSOLUTE_FORM:
        data = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        live.append(_LIVE[status_of(await exchange(gw.port, data))])
    simulation = Simulation(parse_and_build(policy_text, "test.yaml"))
    replayed = []
    for line, (target, host) in enumerate(ABSOLUTE_FORM):
        request = Request(line * 1000, "log", line, "127.0.0.1", "GET", target, host, (), None)
        replayed.append(simulation.decide(request, simulation.client_ip(request)))
    assert replayed == live
    assert live == [ALLOWED, ALLOWED, UNROUTED, DENIED, DENIED, DENIED, ALLOWED]
    assert [r.raw_path for r in upstream.requests] == ["/api/a", "/api/b?x=1", "/api/f"]


# -- the HTML report in a real browser ---------------------------------------------------------


async def test_html_report_opens_offline_in_chromium_and_shows_its_charts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], browser: Browser
) -> None:
    directory = artifacts_dir(tmp_path)

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_replay import generate

    log = tmp_path / "generated.log"
    generate(log, 5_000, 200, 200.0, "combined", seed=3)
    report = tmp_path / "replay.html"
    current = ROOT / "policies" / "default.yaml"
    # layered.yaml and a limit keyed by a header the combined log does not carry: skipped.
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text(
        (ROOT / "policies" / "layered.yaml")
        .read_text()
        .replace(
            "\nlimits:\n",
            "\nlimits:\n  per_key:\n    algorithm: fixed_window\n    limit: 10\n"
            "    window: 1m\n    key: ['header:X-API-Key']\n",
        )
    )
    args = [
        "replay",
        "--config",
        str(candidate),
        "--compare",
        str(current),
        "--html",
        str(report),
        "--json",
        str(log),
    ]
    assert await asyncio.to_thread(main, args) == 0  # the command runs its own event loop
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == f"gateway replay: wrote {report.resolve()}"
    doc = json.loads(out)
    page_text = report.read_text()
    assert "<script src" not in page_text and "<link" not in page_text  # all inlined
    # A chart per policy, and one per limit that decided something: none for a limit that
    # never applied (an empty chart would read as no traffic), named in a note instead.
    decided = [[lim["name"] for lim in p["limits"] if lim["decided"]] for p in doc["policies"]]
    skipped = [[lim["name"] for lim in p["limits"] if not lim["decided"]] for p in doc["policies"]]
    assert skipped == [["per_key"], []]
    charts = sum(1 + len(names) for names in decided)
    # A viewer half an hour off UTC: the times must still read as the log's (UTC).
    context = await browser.new_context(
        viewport={"width": 1400, "height": 1000}, timezone_id="Asia/Kolkata"
    )
    page = await context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(report.as_uri())
    await page.wait_for_selector('[data-rendered="true"]', timeout=10_000)
    assert await page.locator('[data-rendered="true"]').count() == charts
    assert await page.locator(".uplot canvas").count() == charts
    title = await page.locator(".u-title").first.inner_text()
    assert title == "all requests"
    assert "per_ip" in await page.inner_text("#policy-0")
    for index, names in enumerate(skipped):
        if names:
            note = f"Decided no request (no chart): {', '.join(names)}."
            assert note in await page.inner_text(f"#policy-{index}")
    # The two policies on one scale, chart by chart.
    for name in ("overall", *set(decided[0]) & set(decided[1])):
        tops = await page.eval_on_selector_all(
            f'[data-chart="{name}"]', "(charts) => charts.map((c) => c.dataset.yMax)"
        )
        assert len(tops) == 2 and tops[0] == tops[1], (name, tops)
    # The legend's time under the cursor, at the first chart's left edge.
    plot = page.locator(".u-over").first
    box = await plot.bounding_box()
    assert box is not None
    await page.mouse.move(box["x"] + 2, box["y"] + box["height"] / 2)
    shown = await page.locator(".u-legend .u-series:first-child .u-value").first.inner_text()
    start, end = doc["series_start_s"], doc["series_start_s"] + doc["span_s"]
    minutes = {datetime.fromtimestamp(t, UTC).strftime(":%M") for t in range(start, int(end) + 2)}
    assert any(minute in shown for minute in minutes), (shown, minutes)
    await page.screenshot(path=directory / "replay-report.png", full_page=True)
    await context.close()
    assert errors == []
    assert requested == [report.as_uri()]  # nothing fetched: it works offline


def test_a_store_in_redis_is_replayed_in_process_and_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY)
    policy.write_text(policy.read_text() + "store:\n  url: redis://127.0.0.1:9/0\n")
    doc = replay_json(capsys, "--config", str(policy), str(burst_log(tmp_path)))
    assert limit_of(doc, "per_ip")["rejected"] == 1
    assert any("replayed in process" in note for note in doc["notes"])


def test_generated_log_on_a_terminal_draws_progress_and_reports_throughput(
    tmp_path: Path,
) -> None:
    """The benchmark's log, small (20,000 lines), through the command with stderr on a
    terminal: a progress bar is drawn there and cleared; the report gives lines/s."""
    import pty

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_replay import generate

    log = tmp_path / "generated.log"
    generate(log, 20_000, 500, 800.0, "combined", seed=5)
    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "gateway",
        "replay",
        "--config",
        str(ROOT / "policies" / "layered.yaml"),
        str(log),
    ]
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=terminal, timeout=120, env=env, check=False
        )
        os.close(terminal)
        drawn = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal's other side is closed: all read
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(controller)
    assert done.returncode == 0
    assert b"requests" in drawn and b"%" in drawn and drawn.endswith(b"\r\x1b[K")
    out = done.stdout.decode()
    assert "20,000 lines, 20,000 requests" in out and "lines/s)" in out


def test_the_progress_of_several_logs_is_what_has_been_read_of_all_of_them(
    tmp_path: Path,
) -> None:
    """Logs are merged, so read side by side: nothing read is 0 %, one of two equal logs read
    to its end is 50 % (not the other log's share counted as done from the start)."""
    logs = []
    for name in ("a.log", "b.log"):
        path = tmp_path / name
        path.write_bytes(b"x" * 1000)
        logs.append(open_log(str(path)))
    try:
        shown = io.StringIO()
        Progress(shown, 2000, logs).tick(0)
        assert "  0% " in shown.getvalue(), shown.getvalue()
        logs[0].raw.read()
        shown = io.StringIO()
        Progress(shown, 2000, logs).tick(0)
        assert " 50% " in shown.getvalue(), shown.getvalue()
    finally:
        for log in logs:
            close_log(log)


def test_a_log_without_hosts_under_a_policy_matching_hosts_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = (
        "  example:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n"
        "    key: [global]\n    match: {host: api.example.com}\n"
    )
    policy = write_policy(tmp_path, limits)
    doc = replay_json(capsys, "--config", str(policy), str(burst_log(tmp_path)))
    assert limit_of(doc, "example")["allowed"] == 0  # no request had the host
    assert any("match on the host" in note for note in doc["notes"])


def test_gateway_log_lines_behind_a_logging_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway's JSON access log as the CLI's logging writes it (time, level, logger
    before the object); ``t_us`` decides, not ``ts`` or the order of the lines."""
    policy = write_policy(tmp_path, NGINX_NODELAY.replace("burst: 2", "burst: 0"))
    fields = {
        "client": "192.0.2.4",
        "method": "GET",
        "host": "a",
        "path": "/",
        "route": "all",
        "limit": "allowed",
        "limit_name": None,
        "delay_ms": 0.0,
        "status": 200,
    }
    lines = [
        # written in the order the requests ended; decided 0.9 s apart, then 0.2 s apart
        {**fields, "ts": 10.0, "t_us": 5_900_000},
        {**fields, "ts": 10.0, "t_us": 5_000_000},
        {**fields, "ts": 10.0, "t_us": 6_100_000},
    ]
    log = tmp_path / "gateway.log"
    log.write_text(
        "".join(
            f"2026-11-24 10:00:00,000 INFO gateway.access[42]: {json.dumps(line)}\n"
            for line in lines
        )
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert doc["logs"][0]["format"] == "gateway"
    # 5.0 s admitted; 5.9 s: 1000 - 900 = 100 > 0, rejected; 6.1 s: 1000 - 1100 < 0, admitted.
    per_ip = limit_of(doc, "per_ip")
    assert (per_ip["allowed"], per_ip["rejected"]) == (2, 1)
    assert doc["late"] == 0


def _own_line(log_format: LogFormat, logger: str, message: str, json_line: bool = False) -> str:
    """A line as the gateway's logging writes it to stderr (its own formatter)."""
    record = logging.LogRecord(logger, logging.INFO, __file__, 1, message, None, None)
    if json_line:
        record.json_line = True
    return GatewayFormatter(log_format).format(record) + "\n"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_gateway_log_read_past_the_gateways_own_lines(
    log_format: LogFormat, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON access log shares stderr with the gateway's own lines (a start line, limit and
    upstream lines), text or JSON: the log is told a gateway log and read past them."""
    policy = write_policy(tmp_path, NGINX_NODELAY.replace("burst: 2", "burst: 0"))
    fields = {"client": "192.0.2.4", "method": "GET", "host": "a", "path": "/", "route": "all"}
    access = [
        {**fields, "ts": 10.0, "t_us": t_us, "limit": "allowed", "status": 200}
        for t_us in (5_000_000, 5_500_000, 7_000_000)
    ]
    own = [
        ("gateway", "worker 0 serving on 127.0.0.1:8080 (admin 127.0.0.1:9090), policy p.yaml"),
        ("gateway.limits", "limit per_ip rejected a request (429, retry after 0.5s): {key}"),
        ("gateway.upstream", "upstream app failed: connection refused"),
    ]
    log = tmp_path / "gateway.log"
    log.write_text(
        _own_line(log_format, *own[0])
        + _own_line(log_format, "gateway.access", json.dumps(access[0]), json_line=True)
        + _own_line(log_format, *own[1])
        + "".join(
            _own_line(log_format, "gateway.access", json.dumps(line), json_line=True)
            for line in access[1:]
        )
        + _own_line(log_format, *own[2])
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert doc["logs"][0]["format"] == "gateway"
    assert doc["requests"] == 3 and doc["malformed"]["count"] == 0
    assert "3 of the gateway's own log lines (not access lines) skipped" in doc["notes"]
    per_ip = limit_of(doc, "per_ip")
    assert (per_ip["allowed"], per_ip["rejected"]) == (2, 1)  # 5.5 s: 500 ms after 5.0 s


def test_a_text_access_log_is_refused_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY)
    log = tmp_path / "gateway.log"
    log.write_text(
        _own_line("text", "gateway", "worker 0 serving on 127.0.0.1:8080")
        + _own_line("text", "gateway.access", "ts=10.0 t_us=5000000 client=192.0.2.4 method=GET")
    )
    assert main(["replay", "--config", str(policy), str(log)]) == 1
    assert capsys.readouterr().err == (
        f"gateway replay: {log}: line 2: the gateway's access log in text cannot be replayed: "
        "write it as JSON (server.access_log_format: json)\n"
    )


# -- properties of reading ---------------------------------------------------------------------


@given(
    offsets=st.lists(st.integers(min_value=0, max_value=5_000_000), min_size=0, max_size=60),
    window_us=st.integers(min_value=0, max_value=6_000_000),
)
def test_records_come_out_in_time_order_and_none_is_lost(
    offsets: list[int], window_us: int
) -> None:
    """Whatever the disorder: every record comes out once, instants never go backwards, and a
    record is moved (counted late) only when it is older than the window allows."""
    records = [
        Request(t_us, "log", line, "192.0.2.1", "GET", "/", None, (), None)
        for line, t_us in enumerate(offsets, 1)
    ]
    stats = ReadStats()
    out = list(in_time_order(records, window_us, stats))
    assert sorted(r.line for r in out) == list(range(1, len(records) + 1))
    assert all(a.t_us <= b.t_us for a, b in itertools.pairwise(out))
    moved = [r for r in out if r.t_us != offsets[r.line - 1]]
    assert stats.late == len(moved)
    assert all(r.t_us > offsets[r.line - 1] for r in moved)  # only ever later, never earlier
    newest = 0
    for line, t_us in enumerate(offsets, 1):
        if t_us >= newest - window_us:
            assert line not in {r.line for r in moved}  # within the window: kept its instant
        newest = max(newest, t_us)
    if max(offsets, default=0) - min(offsets, default=0) <= window_us:
        assert stats.late == 0
        # ties in log order
        assert [r.line for r in out] == sorted(
            range(1, len(records) + 1), key=lambda n: (offsets[n - 1], n)
        )


@given(counts=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=8))
def test_requests_of_one_second_are_spread_evenly_inside_it(counts: list[int]) -> None:
    text = "".join(
        combined("203.0.113.1", second) for second, count in enumerate(counts) for _ in range(count)
    )
    opened = Opened("generated", io.StringIO(text), io.BufferedReader(io.BytesIO()), None)
    stats = ReadStats()
    got = list(read_log(opened, "combined", stats))
    assert len(got) == sum(counts)
    index = 0
    for second, count in enumerate(counts):
        instants = [r.t_us - (START + second) * 1_000_000 for r in got[index : index + count]]
        assert instants == [i * 1_000_000 // count for i in range(count)]
        index += count


def test_bytes_that_are_not_utf8_do_not_break_the_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NGINX_NODELAY.replace("burst: 2", "burst: 0"))
    log = tmp_path / "latin1.log"
    line = combined("client-\xe9", 0).encode("latin-1")  # an address field nobody escaped
    log.write_bytes(line * 2)
    report = tmp_path / "report.html"
    assert main(["replay", "--config", str(policy), "--html", str(report), str(log)]) == 0
    assert "client-\ufffd (1)" in capsys.readouterr().out
    assert "client-\ufffd" in report.read_text(encoding="utf-8")


def test_decisions_do_not_depend_on_the_per_line_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Simulation`` keeps each resolved address, routed request line and the facts built
    for a client's request line, and starts afresh past a bound: with bounds of 2, eight
    clients over five request lines (one in absolute form) are decided exactly as with the
    default bounds."""
    import gateway.replay.simulate as simulate

    loaded = load_and_build(
        write_policy(
            tmp_path,
            NGINX_NODELAY + "  api:\n    algorithm: sliding_window\n    limit: 3\n    window: 1s\n"
            "    key: [client_ip]\n    match: {path_prefix: /api/}\n",
        )
    )
    targets = ("/", "/api/a", "/api/b?x=1", "http://example.test/api/c", "/static/app.js")
    hosts = (None, None, None, "example.test", None)  # an absolute-form target's Host agrees
    requests = [
        Request(
            n * 100_000, "log", n, f"192.0.2.{n % 8}", "GET", targets[n % 5], hosts[n % 5], (), None
        )
        for n in range(400)
    ]

    def decide_all(simulation: Simulation) -> list[str]:
        return [simulation.decide(request, simulation.client_ip(request)) for request in requests]

    default = Simulation(loaded)
    expected = decide_all(default)
    monkeypatch.setattr(simulate, "_PEERS_KEPT", 2)
    monkeypatch.setattr(simulate, "_ROUTED_KEPT", 2)
    monkeypatch.setattr(simulate, "_FACTS_KEPT", 2)
    bounded = Simulation(loaded)
    assert decide_all(bounded) == expected
    assert bounded.counters() == default.counters()
    assert {"allowed", "rejected"} <= set(expected)
    assert len(bounded._peers) <= 2 and len(bounded._routed) <= 2 and len(bounded._facts) <= 2


_LINE_PARTS = st.sampled_from(
    [
        combined("203.0.113.1", 0),
        combined("203.0.113.2", 1, "POST", "/api/login"),
        combined("203.0.113.3", 1, extra=' "198.51.100.7" 0.250'),
        combined("203.0.113.4", 2, extra=" 1700000002.500 0.100"),
        combined("203.0.113.5", 2).replace("\n", "\r\n"),
        combined("caf\u00e9", 3),
        combined("203.0.113.6", 3, path="/a b"),
        '203.0.113.7 - - [14/Nov/2023:22:13:23 +0000] "\\x16\\x03" 400 0 "-" "-"\n',
        combined("203.0.113.8", 4).replace("[", "[99/Foo/2023:"),
        '203.0.113.9 - - [14/Nov/2023:22:13:24 +0000] "GET / HTTP/1.1" 200 1 "a\nb" "c"\n',
        "not a log line\n",
        "\n",
        "   \n",
    ]
)


@given(
    parts=st.lists(_LINE_PARTS, max_size=40),
    cut_end=st.booleans(),
    bad_byte=st.integers(min_value=-1, max_value=4000),
    piece_bytes=st.sampled_from([1, 5, 64, 333, 1 << 16]),
)
def test_combined_log_read_in_pieces_is_read_as_line_by_line(
    parts: list[str], cut_end: bool, bad_byte: int, piece_bytes: int
) -> None:
    """A combined log read from bytes, piece by piece, gives the records, line numbers,
    malformed lines and counts that reading the same text line by line gives, wherever the
    pieces end (inside a line, a CRLF, a multi-byte character)."""
    import gateway.replay.log_formats as logs

    data = "".join(parts).encode("utf-8")
    if cut_end:
        data = data.rstrip(b"\n")
    if 0 <= bad_byte < len(data):
        data = data[:bad_byte] + b"\xc3" + data[bad_byte:]  # a cut UTF-8 sequence
    text = data.decode("utf-8", "replace")

    def read(opened: Opened) -> tuple[list[Request], tuple[object, ...]]:
        stats = ReadStats()
        records = list(read_log(opened, "combined", stats))
        kept = tuple(stats.malformed_kept)
        return records, (stats.lines, stats.malformed, kept, stats.has_forwarded_for)

    empty = io.BufferedReader(io.BytesIO())
    expected = read(Opened("log", io.StringIO(text, newline="\n"), empty, None))
    old_size = logs._PIECE_BYTES
    logs._PIECE_BYTES = piece_bytes
    try:
        raw = io.BufferedReader(io.BytesIO(data))
        wrapped = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="\n")
        assert read(Opened("log", wrapped, raw, None)) == expected
    finally:
        logs._PIECE_BYTES = old_size


# Fields of a combined line, and what may stand in for one: the characters the pattern
# treats apart (space, quote, brackets, '-', digits) and a few others.
_FIELD = st.text(alphabet=' "[]-0129aZ/:.', max_size=6)
_STANDARD = (
    '203.0.113.1 - - [14/Nov/2023:22:13:20 +0000] "GET /api/items HTTP/1.1" 200 512 "-" '
    '"Mozilla/5.0 (bench)"'
)


@given(
    fields=st.lists(_FIELD, min_size=11, max_size=11),
    use=st.lists(st.booleans(), min_size=11, max_size=11),
    tail=st.sampled_from(["", ' "-" "curl/8.5"', ' "a" "b" 0.250', " 1700000002.500", ' "x"']),
)
def test_a_combined_line_read_by_hand_has_the_patterns_fields(
    fields: list[str], use: list[bool], tail: str
) -> None:
    """``_fields`` reads a line of a plain piece by hand: whenever it takes a line, the
    pattern matches it with the same groups (it leaves to the pattern what it does not
    take), over lines made of the standard one's fields, each field maybe replaced by a run
    of the characters the pattern treats apart."""
    import gateway.replay.log_formats as logs

    standard = [
        "203.0.113.1", " ", "-", " ", '"u"', " [", "14/Nov/2023:22:13:20 +0000", '] "',
        "GET / HTTP/1.1", '" ', "200 512",
    ]  # fmt: skip
    line = "".join(f if u else s for f, u, s in zip(fields, use, standard, strict=True)) + tail
    found = logs._COMBINED.fullmatch(line)
    text = "\n" + line + "\n"  # inside a piece, between two line ends
    by_hand = logs._fields(text, 1, len(text) - 1)
    if by_hand is not None:
        assert found is not None and by_hand == found.groups()
    if not any(use) and tail != ' "x"':
        assert by_hand is not None  # the common lines are taken


def test_a_plain_piece_is_read_by_hand_as_the_pattern_reads_it() -> None:
    """A piece of ASCII lines goes through ``_fields`` and gives what the pattern gives each
    line (its groups, or the line when it does not match); a tab, a carriage return, another
    ASCII space or a character that is not ASCII sends the piece to the pattern."""
    import gateway.replay.log_formats as logs

    lines = [_STANDARD, _STANDARD.replace(' "-" "Mozilla/5.0 (bench)"', ""), "not a line", ""]
    piece = "\n".join(lines) + "\n"
    assert logs._plain(piece)
    expected: list[object] = []
    for line in lines:
        found = logs._COMBINED.fullmatch(line)
        expected.append(line if found is None else found.groups())
    assert logs._plain_rows(piece) == expected
    assert logs._fields(piece, 0, len(_STANDARD)) == expected[0]
    for other in ("\t", "\r", "\x1f", "\xe9"):
        assert not logs._plain(piece + other)


def test_each_format_is_one_entry_of_the_readers_table() -> None:
    """A first line of each format is told as that format and no other earlier in the table,
    and the CLI offers exactly the table's formats."""
    from gateway.cli.main import build_parser
    from gateway.replay.log_formats import FORMATS, READERS, detect

    first_lines = {
        "gateway": '{"ts": 1.5, "t_us": 1500000, "client": "10.0.0.1", "method": "GET", '
        '"path": "/", "route": "all", "limit": null}',
        "jsonl": '{"ts": 1.5, "ip": "10.0.0.1", "method": "GET", "path": "/"}',
        "combined": '10.0.0.1 - - [10/Oct/2000:13:55:36 -0700] "GET / HTTP/1.1" 200 5 "-" "ua"',
    }
    assert set(first_lines) == set(READERS)
    assert {fmt: detect(line) for fmt, line in first_lines.items()} == {
        fmt: fmt for fmt in first_lines
    }
    assert detect("hello") is None
    parser = build_parser()
    replay_parser = parser._subparsers._group_actions[0].choices["replay"]  # type: ignore[union-attr]
    format_option = next(a for a in replay_parser._actions if "--format" in a.option_strings)
    assert tuple(format_option.choices) == FORMATS


def _records(fmt: str, text: str) -> tuple[list[Request], ReadStats]:
    stats = ReadStats()
    empty = io.BufferedReader(io.BytesIO())
    opened = Opened("log", io.StringIO(text, newline="\n"), empty, None)
    return list(read_log(opened, fmt, stats)), stats  # type: ignore[arg-type]


def test_each_format_gives_the_requests_durations_when_it_logs_them() -> None:
    """What a concurrency limit's replay holds its slots for: nginx's $request_time, the
    gateway's duration_ms, a JSON line's duration_ms or request_time; -1 where not logged."""
    records, stats = _records(
        "combined",
        combined("192.0.2.1", 0, extra=f' "-" {START}.900 0.250')  # $msec, $request_time
        + combined("192.0.2.1", 1, extra=' "-" 0.040')  # $request_time alone
        + combined("192.0.2.1", 2),
    )
    assert [r.duration_us for r in records] == [250_000, 40_000, -1]
    assert records[0].t_us == (START * 1000 + 900 - 250) * 1000  # it arrived 250 ms earlier
    assert stats.durations == 2
    line = {"client": "192.0.2.1", "method": "GET", "path": "/", "route": "all", "limit": None}
    records, stats = _records(
        "gateway",
        json.dumps({**line, "t_us": 1, "duration_ms": 12.5})
        + "\n"
        + json.dumps({**line, "t_us": 2})
        + "\n",
    )
    assert [r.duration_us for r in records] == [12_500, -1]
    assert stats.durations == 1
    base = {"ts": 1.0, "ip": "192.0.2.1", "method": "GET", "path": "/"}
    records, stats = _records(
        "jsonl",
        "".join(
            json.dumps({**base, **extra}) + "\n"
            for extra in ({"request_time": 0.5}, {"duration_ms": 3}, {"duration_ms": -1})
        ),
    )
    assert [r.duration_us for r in records] == [500_000, 3_000]
    assert stats.malformed_kept[0].reason == "'duration_ms' is not a duration"


def test_a_concurrency_limit_holds_each_slot_for_the_logged_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two slots per client. 0.0 s (1 s long) and 0.1 s (1 s) take both; 0.2 s is refused;
    1.05 s gets the slot given back at 1.0 s (and holds it to 1.15 s); 1.06 s is refused (the
    0.1 s request holds the other until 1.1 s); 1.2 s finds both free. Without durations in
    the log, slots are given back at once, and the report says so."""
    policy = write_policy(tmp_path, "  in_flight:\n    algorithm: concurrency\n    limit: 2\n")
    timed = [(0.0, 1.0), (0.1, 1.0), (0.2, 0.1), (1.05, 0.1), (1.06, 0.1), (1.2, 0.1)]
    log = tmp_path / "timed.jsonl"
    log.write_text(
        "".join(
            json.dumps(
                {
                    "ts": START + at,
                    "ip": "192.0.2.7",
                    "method": "GET",
                    "path": "/",
                    "request_time": took,
                }
            )
            + "\n"
            for at, took in timed
        )
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    in_flight = limit_of(doc, "in_flight")
    assert (in_flight["allowed"], in_flight["rejected"]) == (4, 2)
    assert not any("no duration" in note for note in doc["notes"])

    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text(
        "".join(
            json.dumps({"ts": START + at, "ip": "192.0.2.7", "method": "GET", "path": "/"}) + "\n"
            for at, _ in timed
        )
    )
    doc = replay_json(capsys, "--config", str(policy), str(untimed))
    assert (limit_of(doc, "in_flight")["allowed"], limit_of(doc, "in_flight")["rejected"]) == (6, 0)
    assert any(
        "6 requests admitted by a concurrency limit had no duration" in n for n in doc["notes"]
    )

    waiting = write_policy(
        tmp_path,
        "  in_flight:\n    algorithm: concurrency\n    limit: 2\n    max_delay: 1s\n",
        "w.yaml",
    )
    doc = replay_json(capsys, "--config", str(waiting), str(log))
    assert (limit_of(doc, "in_flight")["allowed"], limit_of(doc, "in_flight")["rejected"]) == (4, 2)
    assert any("2 requests would have waited for a concurrency limit" in n for n in doc["notes"])


# Limits charged after the response, replayed from the logged status (and the logged costs).
FAILED_LOGINS = (
    "  failed_logins:\n    algorithm: fixed_window\n    limit: 2\n    window: 15m\n"
    "    count: {statuses: [401]}\n"
)


def test_a_limit_counted_by_status_is_replayed_from_the_logged_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 203.0.113.1: a success, two failures (charged), then a failure and a success refused
    # before the upstream. 203.0.113.2: successes only, never charged.
    lines = [combined("203.0.113.1", 0)]
    lines += [combined("203.0.113.1", s).replace('" 200 ', '" 401 ') for s in (1, 2, 3)]
    lines += [combined("203.0.113.1", 4)]
    lines += [combined("203.0.113.2", s) for s in range(5)]
    log = tmp_path / "access.log"
    log.write_text("".join(lines))
    policy = write_policy(tmp_path, FAILED_LOGINS)
    doc = replay_json(capsys, "--config", str(policy), str(log))
    counted = limit_of(doc, "failed_logins")
    assert (counted["allowed"], counted["rejected"]) == (8, 2)
    assert counted["top_rejected_keys"] == [{"key": "203.0.113.1", "requests": 2}]
    assert any("failed_logins are charged after the response" in n for n in doc["notes"])


def _gateway_line(ts: float, t_us: int, client: str, status: int, **more: Any) -> str:
    fields = {"ts": ts, "t_us": t_us, "client": client, "method": "GET", "path": "/"}
    return json.dumps({**fields, "status": status, "route": "all", **more}) + "\n"


async def test_html_report_of_the_gateways_own_log_charts_it_at_the_logs_own_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], browser: Browser
) -> None:
    """The gateway's log is replayed on its limiter's clock (``t_us``: here 5000 s since the
    host booted); the charts' time axis is the log's calendar time (``ts``), not 1970."""
    policy = write_policy(
        tmp_path, "  per_ip:\n    algorithm: fixed_window\n    limit: 2\n    window: 1m\n"
    )
    boot_us = 5_000_000_000
    log = tmp_path / "gateway.log"
    log.write_text(
        "".join(
            _gateway_line(START + i / 2, boot_us + i * 500_000, "198.51.100.1", 200)
            for i in range(40)
        )
    )
    report = tmp_path / "report.html"
    args = ["replay", "--config", str(policy), "--html", str(report), "--json", str(log)]
    assert await asyncio.to_thread(main, args) == 0  # the command runs its own event loop
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_ts"] == START  # the first line's time
    assert doc["series_start_s"] == START
    assert doc["span_s"] == 19.5
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    await page.goto(report.as_uri())
    await page.wait_for_selector('[data-rendered="true"]', timeout=10_000)
    plot = page.locator(".u-over").first
    box = await plot.bounding_box()
    assert box is not None
    await page.mouse.move(box["x"] + 1, box["y"] + box["height"] / 2)
    shown = await page.locator(".u-legend .u-series:first-child .u-value").first.inner_text()
    await context.close()
    # The legend's time at the chart's left edge: the log's first second, in UTC.
    assert shown == "2023-11-14 10:13pm", shown


def test_logged_costs_are_charged_and_a_log_without_them_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(
        tmp_path,
        "  metered:\n    algorithm: fixed_window\n    limit: 20\n    window: 1h\n"
        "    cost_header: X-Cost\n",
    )
    # 10 + 10 reported: the third request finds the quota used up. Without the costs, each
    # charges its cost (1): all four admitted.
    costs = [{"x-cost": "10"}, {"x-cost": "10"}, {}, {}]
    log = tmp_path / "gateway.log"
    log.write_text(
        "".join(
            _gateway_line(START + i, 1_000_000 * (i + 1), "198.51.100.1", 200, costs=c)
            for i, c in enumerate(costs)
        )
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert (limit_of(doc, "metered")["allowed"], limit_of(doc, "metered")["rejected"]) == (2, 2)
    assert any("the log's costs" in note for note in doc["notes"])
    log.write_text("".join(_gateway_line(START + i, i + 1, "198.51.100.1", 200) for i in range(4)))
    doc = replay_json(capsys, "--config", str(policy), str(log))
    assert (limit_of(doc, "metered")["allowed"], limit_of(doc, "metered")["rejected"]) == (4, 0)
    assert any("which the log does not carry" in note for note in doc["notes"])


def test_calendar_windows_replay_the_gateways_log_on_calendar_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway's ``t_us`` counts from boot; its ``ts`` is calendar time: a daily quota
    replayed across midnight starts afresh at midnight, as it did live."""
    policy = write_policy(
        tmp_path,
        "  daily:\n    algorithm: fixed_window\n    limit: 1\n    window: 1d\n    calendar: true\n",
    )
    midnight = datetime(2024, 3, 1, tzinfo=UTC).timestamp()
    boot_us = 5_000_000_000
    log = tmp_path / "gateway.log"
    log.write_text(
        "".join(
            _gateway_line(midnight + offset_s, boot_us + round(offset_s * 1e6), "198.51.100.1", 200)
            for offset_s in (-1.0, -0.5, 0.5)
        )
    )
    doc = replay_json(capsys, "--config", str(policy), str(log))
    daily = limit_of(doc, "daily")
    assert (daily["allowed"], daily["rejected"]) == (2, 1)


async def test_the_gateways_log_records_reported_costs_and_a_replay_charges_them(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    async def report_cost(request: web.BaseRequest, recorded: RecordedRequest) -> web.Response:
        return web.Response(text="done", headers={"X-Cost": request.headers["X-Want-Cost"]})

    upstream.reply = report_cost
    policy_text = (
        policy_for(upstream.url, server="  access_log: true\n  access_log_format: json\n")
        + "limits:\n  metered:\n    algorithm: fixed_window\n    limit: 20\n    window: 1h\n"
        "    cost_header: X-Cost\n    key: [global]\n"
    )
    gw = await start_gateway(policy_text, clock=FakeClock(1_000_000_000))
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with aiohttp.ClientSession() as session:
            statuses = []
            for cost in ("12", "7", "1", "1"):
                async with session.get(gw.url + "/", headers={"X-Want-Cost": cost}) as resp:
                    await resp.read()
                    statuses.append(resp.status)
    assert statuses == [200, 200, 200, 429]  # 12 + 7 + 1 units: the fourth finds none left
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert [json.loads(line).get("costs") for line in lines] == [
        {"x-cost": "12"},
        {"x-cost": "7"},
        {"x-cost": "1"},
        None,
    ]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(lines) + "\n")
    run = await replay([str(log)], [Simulation(parse_and_build(policy_text, "test.yaml"))])
    counted = run.simulations[0].counters()["metered"]
    assert (counted["allowed"], counted["rejected"]) == (3, 1)
