"""WebSocket relay benchmark on loopback: the upstream directly, nginx, and the gateway.

Starts an aiohttp WebSocket echo upstream, nginx proxying WebSockets to it (``worker_processes
1``), and the gateway (``--workers 1``, no limits), then in interleaved rounds drives each with
an aiohttp client: ``echo`` (small text messages, a window of them in flight) and ``bulk``
(4 MiB binary frames echoed). Prints per target the median messages/s and MB/s, and the proxy's
own CPU time per message and per MB (from /proc, its process group), with the gateway/nginx
ratios. Everything it starts is killed on exit. See bench/README.md.

    python bench/bench_websocket.py --messages 20000 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
NGINX = "/usr/sbin/nginx"
_TICK = os.sysconf("SC_CLK_TCK")

UPSTREAM = """
import sys
from aiohttp import WSMsgType, web

async def handle(request):
    ws = web.WebSocketResponse(max_msg_size=0)
    await ws.prepare(request)
    async for msg in ws:
        if msg.type == WSMsgType.TEXT:
            await ws.send_str(msg.data)
        elif msg.type == WSMsgType.BINARY:
            await ws.send_bytes(msg.data)
    return ws

app = web.Application()
app.router.add_get("/{tail:.*}", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection "upgrade";
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def group_cpu_s(pgid: int) -> float:
    """User and system CPU seconds of every live process in the process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


async def wait_open(url: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.ws_connect(url) as ws:
                    await ws.send_str("ping")
                    if await ws.receive_str() == "ping":
                        return
            except (aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer within {within_s}s")
            await asyncio.sleep(0.2)


async def echo(url: str, messages: int, window: int) -> float:
    """Messages per second echoed, ``window`` in flight."""
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        started = time.perf_counter()
        sent = 0
        for _ in range(min(window, messages)):
            await ws.send_str(f"m{sent}")
            sent += 1
        for received in range(messages):
            assert await ws.receive_str() == f"m{received}"
            if sent < messages:
                await ws.send_str(f"m{sent}")
                sent += 1
        return messages / (time.perf_counter() - started)


async def bulk(url: str, frames: int, size: int) -> float:
    """MB/s echoed (counted once, one way) with ``size``-byte binary frames."""
    payload = os.urandom(size)
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, max_msg_size=0) as ws,
    ):
        started = time.perf_counter()
        for _ in range(frames):
            await ws.send_bytes(payload)
            assert len(await ws.receive_bytes()) == size
        return frames * size / 1e6 / (time.perf_counter() - started)


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000, help="echoed per echo run")
    parser.add_argument("--window", type=int, default=64, help="echo messages in flight")
    parser.add_argument("--frames", type=int, default=25, help="4 MiB frames per bulk run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-ws-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        procs.append(start([sys.executable, "-c", UPSTREAM, str(up_port)], tmp / "up.log"))
        targets = {"direct": (f"ws://127.0.0.1:{up_port}/ws", procs[0])}
        if shutil.which(NGINX):
            port = free_port()
            conf = tmp / "nginx.conf"
            conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=up_port))
            procs.append(start([NGINX, "-p", str(tmp), "-c", str(conf)], tmp / "nginx.log"))
            targets["nginx"] = (f"ws://127.0.0.1:{port}/ws", procs[-1])
        port, admin = free_port(), free_port()
        gateway = [sys.executable, "-m", "gateway", "run", "--upstream"]
        gateway += [f"http://127.0.0.1:{up_port}", "--listen", f"127.0.0.1:{port}"]
        gateway += ["--admin-listen", f"127.0.0.1:{admin}", "--workers", "1"]
        procs.append(start(gateway, tmp / "gateway.log"))
        targets["gateway"] = (f"ws://127.0.0.1:{port}/ws", procs[-1])
        for url, _ in targets.values():
            await wait_open(url)

        rows: dict[str, dict[str, list[float]]] = {
            name: {"msg/s": [], "MB/s": [], "cpu_us/msg": [], "cpu_ms/MB": []} for name in targets
        }
        size = 4 * 1024 * 1024
        for round_ in range(args.repeats):
            for name, (url, proc) in targets.items():
                # Proxy CPU only: the upstream's own CPU is in every row alike.
                own = proc.pid if name != "direct" else None
                before = group_cpu_s(own) if own else 0.0
                rate = await echo(url, args.messages, args.window)
                middle = group_cpu_s(own) if own else 0.0
                mbps = await bulk(url, args.frames, size)
                after = group_cpu_s(own) if own else 0.0
                row = rows[name]
                row["msg/s"].append(rate)
                row["MB/s"].append(mbps)
                # both directions relayed: 2 messages, 2 x size bytes per echo
                row["cpu_us/msg"].append((middle - before) * 1e6 / (2 * args.messages))
                row["cpu_ms/MB"].append((after - middle) * 1e3 / (2 * args.frames * size / 1e6))
                print(
                    f"round {round_ + 1} {name}: {rate:.0f} msg/s, {mbps:.0f} MB/s", file=sys.stderr
                )

        print(
            f"\n{args.messages} messages ({args.window} in flight) and {args.frames} frames "
            f"of 4 MiB echoed per run, medians of {args.repeats} rounds\n"
        )
        print("| target | echo msg/s | bulk MB/s | proxy CPU µs/msg | proxy CPU ms/MB |")
        print("|---|---:|---:|---:|---:|")
        med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
        for name, m in med.items():
            cpu = "-" if name == "direct" else f"{m['cpu_us/msg']:.1f}"
            cpu_mb = "-" if name == "direct" else f"{m['cpu_ms/MB']:.2f}"
            print(f"| {name} | {m['msg/s']:.0f} | {m['MB/s']:.0f} | {cpu} | {cpu_mb} |")
        if "nginx" in med:
            g, n = med["gateway"], med["nginx"]
            cpu_msg = g["cpu_us/msg"] / n["cpu_us/msg"]
            cpu_mb = g["cpu_ms/MB"] / n["cpu_ms/MB"]
            print(
                f"\ngateway/nginx: msg/s {g['msg/s'] / n['msg/s']:.2f}, MB/s "
                f"{g['MB/s'] / n['MB/s']:.2f}; CPU per message {cpu_msg:.2f}x nginx's, "
                f"per MB {cpu_mb:.2f}x"
            )
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
