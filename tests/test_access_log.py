"""The access log as configured: a file, JSON with the chosen headers (credentials hashed) or an
nginx-style template, reopened on SIGUSR1 by every worker after logrotate renames it, and
replayed by ``gateway replay`` to the decisions the live gateway made."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build, parse_and_build
from gateway.policy.loader import PolicyError
from gateway.redact import hashed
from gateway.replay.log_formats import detect
from tests.support.conformance import T0_US
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for, policy_template
from tests.support.processes import StartGateway
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int:
    async with session.get(url, headers=headers) as response:
        await response.read()
        return response.status


async def test_json_lines_go_to_the_file_with_the_chosen_headers_secrets_hashed(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    policy = policy_for(
        upstream.url,
        server=f"  access_log:\n    path: {log}\n"
        "    fields: [X-Api-Key, X-Team, X-Tenant, User-Agent, Authorization, X-Absent]\n"
        "    raw: [X-Tenant]\n",
        extra="limits:\n  per_team:\n    algorithm: fixed_window\n    limit: 100\n"
        "    window: 1h\n    key: ['header:X-Team']\n"
        "  per_tenant:\n    algorithm: fixed_window\n    limit: 100\n    window: 1h\n"
        "    key: ['header:X-Tenant']\n",
    )
    gw = await start_gateway(policy)
    sent = {
        "X-Api-Key": "k-secret-0123456789",
        "X-Team": "team-blue",  # a limit keys on it: hashed
        "X-Tenant": "tenant-7",  # a limit keys on it, but raw says written as sent
        "User-Agent": "curl/8.5",
        "Authorization": "Bearer abc.def.ghi",
    }
    async with aiohttp.ClientSession() as session:
        for index in range(3):
            assert await _get(session, f"{gw.url}/r/{index}", sent) == 200
    await wait_until(lambda: len(_lines(log)) == 3, "three lines in the file")
    lines = [json.loads(line) for line in _lines(log)]
    assert [line["path"] for line in lines] == ["/r/0", "/r/1", "/r/2"]
    assert lines[0]["headers"] == {
        "X-Api-Key": hashed("k-secret-0123456789"),
        "X-Team": hashed("team-blue"),
        "X-Tenant": "tenant-7",
        "User-Agent": "curl/8.5",
        "Authorization": hashed("Bearer abc.def.ghi"),
    }
    assert (
        hashed("k-secret-0123456789")
        == "sha256:" + (__import__("hashlib").sha256(b"k-secret-0123456789").hexdigest()[:12])
    )
    text = log.read_text()
    for secret in ("k-secret", "team-blue", "abc.def.ghi"):
        assert secret not in text
    assert {"ts", "t_us", "client", "status", "limit", "time"} <= set(lines[0])
    assert os.stat(log).st_mode & 0o777 == 0o640


async def test_credentials_in_the_query_are_logged_hashed_and_replay_keys_on_the_hash(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``?api_key=`` and ``?access_token=`` are credentials by their names, ``?tenant=`` one
    because a limit keys on it: their values are written hashed in the JSON ``path`` and in a
    template's ``$request``, ``$request_uri`` and ``$args``; other parameters as sent; a
    replay of the JSON log keys the ``query:`` limit on the hash as the gateway keyed on the
    value, and finds the tenant's override (2, not the default 1) by the hash."""
    log = tmp_path / "access.log"
    lines_of_template = tmp_path / "template.log"
    limits = (
        "limits:\n  per_tenant:\n    algorithm: fixed_window\n    limit: 1\n"
        "    window: 1h\n    key: ['query:tenant']\n    overrides: {acme: {limit: 2}}\n"
    )
    policy = policy_for(upstream.url, server=f"  access_log:\n    path: {log}\n", extra=limits)
    # A fake clock, logged as the requests' instants (t_us) and replayed on them: on the real
    # one the hour could end between tenant acme's requests.
    clock = FakeClock(T0_US)
    gw = await start_gateway(policy, clock=clock)
    template = "$request|$request_uri|$args|$uri"
    templated = policy_for(
        upstream.url,
        server=f"  access_log:\n    path: {lines_of_template}\n    format: '{template}'\n",
        extra=limits,
    )
    gw_template = await start_gateway(templated, clock=clock)
    targets = [
        "/v1/a?api_key=k-secret-1&page=2",
        "/v1/b?page=3&Access_Token=tok%2Fsecret&tenant=acme",
        "/v1/c?tenant=acme&q=x",
        "/v1/d?tenant=acme",  # the third of tenant acme: 429
    ]
    async with aiohttp.ClientSession() as session:
        statuses = [await _get(session, gw.url + target, {}) for target in targets]
        await _get(session, gw_template.url + targets[1], {})
    assert statuses == [200, 200, 200, 429]
    await wait_until(lambda: len(_lines(log)) == 4, "four lines in the file")
    await wait_until(lambda: len(_lines(lines_of_template)) == 1, "one templated line")
    paths = [json.loads(line)["path"] for line in _lines(log)]
    assert paths == [
        f"/v1/a?api_key={hashed('k-secret-1')}&page=2",
        f"/v1/b?page=3&Access_Token={hashed('tok/secret')}&tenant={hashed('acme')}",
        f"/v1/c?tenant={hashed('acme')}&q=x",
        f"/v1/d?tenant={hashed('acme')}",
    ]
    query = f"page=3&Access_Token={hashed('tok/secret')}&tenant={hashed('acme')}"
    assert _lines(lines_of_template) == [f"GET /v1/b?{query} HTTP/1.1|/v1/b?{query}|{query}|/v1/b"]
    for secret in ("k-secret-1", "tok%2Fsecret", "acme"):
        assert secret not in log.read_text() + lines_of_template.read_text()
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    capsys.readouterr()
    replayed = ["replay", "--json", "--config", str(policy_file), str(log)]
    assert await asyncio.to_thread(main, replayed) == 0
    doc = json.loads(capsys.readouterr().out)
    limit = next(lim for lim in doc["policies"][0]["limits"] if lim["name"] == "per_tenant")
    # The first request has no tenant (no key: not counted); acme's three: two, then a 429.
    assert (limit["allowed"], limit["rejected"]) == (2, 1)


async def test_a_template_writes_nginx_style_lines_escaping_what_the_client_sent(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    template = (
        '$remote_addr - $remote_user [$time_local] "$request" $status - "$http_referer" '
        '"$http_user_agent" $msec $request_time ${http_x_api_key} $limit_result $route'
    )
    policy = policy_for(
        upstream.url, server=f"  access_log:\n    path: {log}\n    format: '{template}'\n"
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession() as session:
        headers = {"User-Agent": 'evil" 200 "x\u00e9', "X-Api-Key": "key-1"}
        assert await _get(session, f"{gw.url}/a/b?c=d", headers) == 200
    await wait_until(lambda: len(_lines(log)) == 1, "one line in the file")
    (line,) = _lines(log)
    pattern = (
        r'127\.0\.0\.1 - - \[\d\d/\w{3}/\d{4}:\d\d:\d\d:\d\d [+-]\d{4}\] "GET /a/b\?c=d HTTP/1\.1" '
        r'200 - "-" "evil\\x22 200 \\x22x\\xC3\\xA9" \d{10}\.\d{3} \d+\.\d{3} '
        + re.escape(hashed("key-1"))
        + r" none all"
    )
    assert re.fullmatch(pattern, line), line
    # The template above is nginx's combined with two numbers after it: replay reads it so.
    assert detect(line) == "combined"


@pytest.mark.parametrize(
    ("access_log", "message"),
    [
        (
            "{format: '$remote_addr $body_bytes_sent'}",
            "server.access_log.format: $body_bytes_sent: the gateway does not count the "
            "bytes of each response: write - in its place",
        ),
        (
            "{format: '$remote_addr $upstream_addr'}",
            "server.access_log.format: unknown variable $upstream_addr: expected $http_NAME "
            "(a request header) or one of $remote_addr, ",
        ),
        (
            "{format: 'price $ 5 $status'}",
            "server.access_log.format: a $ that names no variable: write $name or ${name}",
        ),
        (
            "{format: '$status', fields: [X-Api-Key]}",
            "server.access_log.fields: fields are carried by the json format",
        ),
        ("{path: ''}", "server.access_log.path: an empty path"),
        ("{raw: [x-bypass]}", "server.access_log.raw: x-bypass is an exempt_headers header"),
        ("{pth: access.log}", "server.access_log.pth: unknown key: did you mean `path`?"),
        ("3", "server.access_log: expected true or false, got a number"),
    ],
)
def test_a_bad_access_log_setting_is_one_line_with_its_place(
    tmp_path: Path, access_log: str, message: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_for("http://127.0.0.1:9", server=f"  access_log: {access_log}\n")
        + "limits:\n  vip:\n    algorithm: fixed_window\n    limit: 5\n    window: 1m\n"
        "    exempt_headers: {X-Bypass: [letmein-0123]}\n"
    )
    with pytest.raises(PolicyError) as info:
        load_and_build(policy)
    assert str(info.value).startswith(f"{policy}:4: {message}"), str(info.value)


def test_access_log_format_beside_the_settings_is_refused(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_for(
            "http://127.0.0.1:9",
            server="  access_log: {path: a.log}\n  access_log_format: json\n",
        )
    )
    with pytest.raises(PolicyError) as info:
        load_and_build(policy)
    assert "give the format as access_log.format" in str(info.value)


def test_check_says_when_the_file_cannot_be_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_for("http://127.0.0.1:9", server="  access_log: {path: missing/access.log}\n")
    )
    assert main(["check", str(policy)]) != 0
    err = capsys.readouterr().err
    assert (
        f"server.access_log.path: cannot create {tmp_path}/missing/access.log: its directory "
        "is missing or not writable"
    ) in err


async def test_sigusr1_reopens_the_file_in_every_worker_after_logrotate_renames_it(
    upstream: RecordingUpstream, gateway_process: StartGateway, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    rotated = tmp_path / "access.log.1"
    policy = policy_template(upstream.url, server=f"  access_log:\n    path: {log}\n")
    gateway = await gateway_process("--workers", "2", policy=policy)

    async def send(paths: range) -> None:
        # A connection per request: the kernel spreads them over both workers' listeners.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            for index in paths:
                assert await _get(session, f"{gateway.url}/r/{index}", {}) == 200

    await send(range(30))
    await wait_until(lambda: len(_lines(log)) == 30, "30 lines", 10.0, context=gateway.log)
    log.rename(rotated)  # what logrotate does, then its postrotate line:
    os.kill(gateway.proc.pid, signal.SIGUSR1)
    reopened = re.compile(r"gateway\[(\d+)\]: SIGUSR1: access log .* reopened")
    await wait_until(
        lambda: len(set(reopened.findall(gateway.log()))) == 2,
        "both workers reopened the file",
        10.0,
        context=gateway.log,
    )
    await send(range(30, 60))
    await wait_until(lambda: len(_lines(log)) == 30, "30 lines in the new file", 10.0)
    before = [json.loads(line)["path"] for line in _lines(rotated)]
    after = [json.loads(line)["path"] for line in _lines(log)]
    assert sorted(before) == sorted(f"/r/{i}" for i in range(30))
    assert sorted(after) == sorted(f"/r/{i}" for i in range(30, 60))
    assert gateway.proc.returncode is None  # the signal ended no process


# -- replayed: the gateway's own log decides header-keyed and plan limits as it did --------------

KEYED_LIMITS = (
    "  per_key:\n    algorithm: fixed_window\n    limit: 2\n    window: 1h\n"
    "    key: ['header:X-Api-Key']\n    plans: {gold: {limit: 5}}\n"
    "    overrides: {gold-key-0001: gold}\n"
    # One budget per plan: the gold plan's 6, the unlisted keys' 3 together.
    "  per_plan:\n    algorithm: fixed_window\n    limit: 3\n    window: 1h\n"
    "    key: ['plan:per_key']\n    overrides: {gold: {limit: 6}}\n"
)


async def test_replay_of_the_gateways_own_log_decides_header_keyed_and_plan_limits_as_it_did(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        policy_for(upstream.url, server=f"  access_log: {{path: {log}, fields: [X-Api-Key]}}\n")
        + "limits:\n"
        + KEYED_LIMITS
    )
    # A fake clock, logged as the requests' instants (t_us) and replayed on them: on the real
    # one the hour could end between the requests.
    gw = await start_gateway(load_and_build(policy_file), clock=FakeClock(T0_US))
    keys = ["gold-key-0001"] * 7 + ["k-one"] * 3 + ["k-two"] * 4 + [""] * 2
    statuses = []
    async with aiohttp.ClientSession() as session:
        for index, key in enumerate(keys):
            headers = {"X-Api-Key": key} if key else {}
            statuses.append(await _get(session, f"{gw.url}/r/{index}", headers))
    await wait_until(lambda: len(_lines(log)) == len(keys), "a line per request")
    assert "gold-key" not in log.read_text()
    live: dict[str, dict[str, int]] = {
        limit.name: {"allowed": limit.counters.allowed, "rejected": limit.counters.rejected}
        for limit in gw.gateway.handler.runtime.engine.limits
    }
    # The gold key's plan admits 5 of its 7 (found by the hash of its key in the replay); the
    # other keys 2 each, but their plan's budget, shared (requests without a key too), runs
    # out at the third.
    assert statuses == [200] * 5 + [429] * 2 + [200, 200, 429] + [200, 429, 429, 429] + [429] * 2

    args = ["replay", "--json", "--no-progress", "--config", str(policy_file), str(log)]
    doc = await _replay(args)
    replayed = {
        limit["name"]: {"allowed": limit["allowed"], "rejected": limit["rejected"]}
        for limit in doc["policies"][0]["limits"]
    }
    assert replayed == live
    outcomes = doc["policies"][0]["outcomes"]
    assert outcomes["rejected"] == statuses.count(429)
    assert not any("key parts" in note for note in doc["notes"])


async def _replay(args: list[str]) -> dict[str, Any]:
    """``gateway replay`` (it runs its own event loop: in a thread), its JSON document."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await asyncio.to_thread(main, args) == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


async def test_a_reload_moves_the_log_to_a_new_path_and_one_it_cannot_open_is_refused(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    first, second = tmp_path / "first.log", tmp_path / "second.log"

    def policy(path: Path) -> str:
        return policy_for(upstream.url, server=f"  access_log:\n    path: {path}\n")

    gw = await start_gateway(policy(first))
    async with aiohttp.ClientSession() as session:
        assert await _get(session, f"{gw.url}/one", {}) == 200
        gw.gateway.apply(parse_and_build(policy(second), "test.yaml"))
        assert await _get(session, f"{gw.url}/two", {}) == 200
        with pytest.raises(ValueError, match=r"server\.access_log\.path: cannot open .*/missing/"):
            gw.gateway.apply(parse_and_build(policy(tmp_path / "missing" / "x.log"), "test.yaml"))
        assert await _get(session, f"{gw.url}/three", {}) == 200
    await wait_until(lambda: len(_lines(second)) == 2, "two lines in the second file")
    assert [json.loads(line)["path"] for line in _lines(first)] == ["/one"]
    assert [json.loads(line)["path"] for line in _lines(second)] == ["/two", "/three"]


async def test_run_refuses_to_start_when_the_file_cannot_be_opened(
    upstream: RecordingUpstream, gateway_process: StartGateway, tmp_path: Path
) -> None:
    path = tmp_path / "missing" / "access.log"
    policy = policy_template(upstream.url, server=f"  access_log:\n    path: {path}\n")
    gateway = await gateway_process(policy=policy, wait_ready=False)
    assert await asyncio.wait_for(gateway.proc.wait(), 60) != 0
    assert (
        f"gateway: server.access_log.path: cannot open {path}: No such file or directory"
        in gateway.log()
    )


async def test_sigusr1_to_a_single_worker_logging_to_stderr_ends_nothing(
    upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    policy = policy_template(upstream.url, server="  access_log: true\n")
    gateway = await gateway_process(policy=policy)
    os.kill(gateway.proc.pid, signal.SIGUSR1)
    await wait_until(
        lambda: "SIGUSR1: no access log file to reopen" in gateway.log(),
        "the signal said so",
        10.0,
        context=gateway.log,
    )
    async with aiohttp.ClientSession() as session:
        assert await _get(session, f"{gateway.url}/after", {}) == 200
    assert gateway.proc.returncode is None
