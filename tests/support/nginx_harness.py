"""A real nginx for differential tests, and a replayer that sends requests at planned instants.

nginx runs as the current user from its own temporary prefix (``daemon off; master_process
off;``: one process, one event loop), listening on a free loopback port, logging to a file in
the prefix. Zones are keyed by request headers so one machine can act as many clients.

Two nginx facts the configuration depends on:

* ``return 200`` runs in the rewrite phase, *before* ``limit_req`` (preaccess), so a location
  that only says ``return 200`` is never limited. The limited locations serve a static file
  (``try_files /ok.txt =404``), which runs in the content phase, after the limit.
* ``$limit_req_status`` (PASSED / DELAYED / REJECTED, nginx 1.17.6+) and ``$request_time`` are
  sent back as response headers, so each response says what nginx decided and how long it held
  the request.

Timing: both nginx (``ngx_current_msec``) and Python's ``time.monotonic_ns`` read
``CLOCK_MONOTONIC``, so instants recorded here are on nginx's own clock. nginx refreshes its
cached millisecond once per event-loop iteration (after ``epoll_wait`` returns; no
``timer_resolution`` is set, which would coarsen it), so the time nginx judged a request at lies
between our send instant and the first response byte (less the time nginx held it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httptools

from tests.support.network import free_port

NGINX_BIN = Path("/usr/sbin/nginx")
STARTUP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Zone:
    """``limit_req_zone <key> zone=<name>:1m rate=<rate>;``"""

    name: str
    key: str  # an nginx variable, e.g. "$http_x_client"
    rate: str  # "10r/s", "30r/m"


@dataclass(frozen=True, slots=True)
class Limit:
    """``limit_req zone=<zone> [burst=N] [nodelay | delay=N];``"""

    zone: Zone
    burst: int = 0
    nodelay: bool = False
    delay: int | None = None

    def directive(self) -> str:
        parts = [f"limit_req zone={self.zone.name}"]
        if self.burst:
            parts.append(f"burst={self.burst}")
        if self.nodelay:
            parts.append("nodelay")
        if self.delay is not None:
            parts.append(f"delay={self.delay}")
        return " ".join(parts) + ";"


@dataclass(frozen=True, slots=True)
class Location:
    path: str  # a prefix location, e.g. "/steady"
    limits: tuple[Limit, ...]


def render_config(prefix: Path, port: int, locations: Sequence[Location]) -> str:
    zones = {limit.zone for location in locations for limit in location.limits}
    zone_lines = "\n".join(
        f"    limit_req_zone {zone.key} zone={zone.name}:1m rate={zone.rate};"
        for zone in sorted(zones, key=lambda zone: zone.name)
    )
    location_blocks = "\n".join(
        f"        location {location.path} {{\n"
        + "".join(f"            {limit.directive()}\n" for limit in location.limits)
        + "            try_files /ok.txt =404;\n        }"
        for location in locations
    )
    temp_paths = "\n".join(
        f"    {kind}_temp_path {prefix / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process off;
worker_processes 1;
error_log {prefix / "error.log"} debug;
pid {prefix / "nginx.pid"};
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp_paths}
    default_type text/plain;
    keepalive_timeout 0;
    limit_req_status 429;
{zone_lines}
    server {{
        listen 127.0.0.1:{port};
        root {prefix / "html"};
        add_header X-Limit-Req $limit_req_status always;
        add_header X-Request-Time $request_time always;
{location_blocks}
    }}
}}
"""


@dataclass
class Nginx:
    prefix: Path
    port: int
    process: subprocess.Popen[bytes]

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"


def _wait_listening(nginx: Nginx) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if nginx.process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", nginx.port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


@contextmanager
def running_nginx(
    prefix: Path, locations: Sequence[Location], attempts: int = 5
) -> Iterator[Nginx]:
    """Start nginx with ``locations``; retry on another port if the free port was taken meanwhile
    (other test runs share the machine)."""
    (prefix / "html").mkdir(parents=True, exist_ok=True)
    (prefix / "html" / "ok.txt").write_text("ok\n")
    for _ in range(attempts):
        port = free_port()
        config = prefix / "nginx.conf"
        config.write_text(render_config(prefix, port, locations))
        (prefix / "error.log").write_text("")
        process = subprocess.Popen(
            [str(NGINX_BIN), "-p", str(prefix), "-c", str(config), "-e", str(prefix / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        nginx = Nginx(prefix, port, process)
        if _wait_listening(nginx):
            break
        _stop(process)
        log = (prefix / "error.log").read_text()
        if "Address already in use" not in log:
            raise RuntimeError(f"nginx did not start:\n{log}")
    else:
        raise RuntimeError("nginx found no free port")
    try:
        yield nginx
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    if process.stderr is not None:
        process.stderr.close()


# --- replay -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send ``at_ms`` after the replay starts."""

    at_ms: float
    path: str
    headers: tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Exchange:
    planned: Planned
    target: str  # the request target sent, unique per request (it names it in nginx's log)
    send_ns: int = 0  # CLOCK_MONOTONIC just before the request bytes were written
    first_byte_ns: int = 0  # CLOCK_MONOTONIC when the first response byte was read
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def limit_req_status(self) -> str:
        return self.headers.get("x-limit-req", "")

    @property
    def request_time_ms(self) -> int:
        """How long nginx held the request, by its own (wall, millisecond) clock."""
        return round(float(self.headers.get("x-request-time", "0")) * 1000)

    @property
    def latency_ms(self) -> float:
        return (self.first_byte_ns - self.send_ns) / 1e6


class _ResponseHead:
    """httptools callbacks collecting the status and the headers."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_message_complete(self) -> None:
        self.complete = True


async def _one(
    port: int, exchange: Exchange, start_ns: int, connect_ahead_s: float, timeout_s: float
) -> None:
    send_at_ns = start_ns + round(exchange.planned.at_ms * 1e6)
    await asyncio.sleep(max(0.0, (send_at_ns - time.monotonic_ns()) / 1e9 - connect_ahead_s))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head_lines = "".join(f"{name}: {value}\r\n" for name, value in exchange.planned.headers)
        request = (
            f"GET {exchange.target} HTTP/1.1\r\nHost: nginx-diff\r\n{head_lines}"
            "Connection: close\r\n\r\n"
        ).encode("latin-1")
        await asyncio.sleep(max(0.0, (send_at_ns - time.monotonic_ns()) / 1e9))
        exchange.send_ns = time.monotonic_ns()
        writer.write(request)  # no half-close: nginx treats EOF on a delayed request as a 499
        head = _ResponseHead()
        parser = httptools.HttpResponseParser(head)
        async with asyncio.timeout(timeout_s):
            while not head.complete:
                chunk = await reader.read(65536)
                if not exchange.first_byte_ns:
                    exchange.first_byte_ns = time.monotonic_ns()
                if not chunk:
                    break
                parser.feed_data(chunk)
        exchange.status = parser.get_status_code()
        exchange.headers = head.headers
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def replay(
    port: int,
    plan: Sequence[Planned],
    *,
    tag: str,
    lead_s: float = 0.5,
    connect_ahead_s: float = 0.05,
    timeout_s: float = 30.0,
) -> list[Exchange]:
    """Send every planned request at its instant, each on a connection opened just before, and
    collect what came back. ``tag`` makes each request target unique in nginx's error log."""
    exchanges = [
        Exchange(planned, f"{planned.path}?{tag}={index}") for index, planned in enumerate(plan)
    ]
    start_ns = time.monotonic_ns() + round(lead_s * 1e9)
    await asyncio.gather(
        *(_one(port, exchange, start_ns, connect_ahead_s, timeout_s) for exchange in exchanges)
    )
    return exchanges


# --- nginx's error log --------------------------------------------------------------------------
# The Debian nginx is built --with-debug, so ``error_log ... debug`` shows every zone lookup of
# every request: ``limit_req[n]: rc excess`` (ngx_http_limit_req_handler's debug line), tied to
# its request through the connection number (one request per connection here).

NGX_OK, NGX_AGAIN, NGX_BUSY = 0, -2, -3

_REQUEST_LINE = re.compile(r'\*(?P<conn>\d+) http request line: "GET (?P<target>\S+) HTTP/1\.1"')
_LOOKUP = re.compile(
    r"\*(?P<conn>\d+) limit_req\[(?P<n>\d+)\]: (?P<rc>-?\d+) (?P<i>\d+)\.(?P<f>\d{3})"
)
_VERDICT = re.compile(
    r"\*(?P<conn>\d+) (?P<what>delaying request|limiting requests), excess: \d+\.\d{3},? "
    r'by zone "(?P<zone>[^"]+)"'
)


@dataclass(frozen=True, slots=True)
class Lookup:
    """One zone lookup as nginx logged it: zone index, return code, excess in milli-requests."""

    index: int
    rc: int
    excess_milli: int


@dataclass(slots=True)
class NginxRecord:
    """What nginx's log says about one request."""

    lookups: list[Lookup] = field(default_factory=list)
    blamed_zone: str | None = None  # the zone named by "delaying request" / "limiting requests"


def nginx_records(error_log: Path) -> dict[str, NginxRecord]:
    """Per request target, the lookups nginx made and the zone it blamed."""
    by_connection: dict[str, NginxRecord] = {}
    targets: dict[str, str] = {}
    for line in error_log.read_text(errors="replace").splitlines():
        if (match := _LOOKUP.search(line)) is not None:
            record = by_connection.setdefault(match["conn"], NginxRecord())
            excess = int(match["i"]) * 1000 + int(match["f"])
            record.lookups.append(Lookup(int(match["n"]), int(match["rc"]), excess))
        elif (match := _VERDICT.search(line)) is not None:
            by_connection.setdefault(match["conn"], NginxRecord()).blamed_zone = match["zone"]
        elif (match := _REQUEST_LINE.search(line)) is not None:
            targets[match["conn"]] = match["target"]
    return {
        target: by_connection.get(connection, NginxRecord())
        for connection, target in targets.items()
    }


def nginx_available() -> bool:
    return NGINX_BIN.exists() and os.access(NGINX_BIN, os.X_OK)
