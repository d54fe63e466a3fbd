"""What a token limit costs a streamed completion: the gateway relaying a 1,000-event
OpenAI-compatible stream (asked for its usage) with a ``cost_from: openai`` limit, against the
same gateway with no limit; and a non-streamed completion with that limit against a
``cost_header`` limit.

Starts an upstream (a subprocess answering ``POST /v1/chat/completions``: a stream of
``--events`` chunks written one at a time, then its usage; or a JSON body with the usage and an
``X-Tokens`` header), and one gateway process (``--workers 1``) per policy. In interleaved
rounds, a client fetches ``--streams`` streams (4 at a time) through each gateway and reads them
to their end; the gateway's own CPU (its process group, from /proc) per stream is the figure.
Everything it starts is killed on exit. See bench/README.md.

    python bench/bench_stream_relay.py --streams 200 --repeats 3
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
_TICK = os.sysconf("SC_CLK_TCK")

UPSTREAM = """
import json, sys
from aiohttp import web

EVENTS = int(sys.argv[2])
BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHUNK = b"data: " + json.dumps(
    {**BASE, "choices": [{"index": 0, "delta": {"content": "word "}}], "usage": None}
).encode() + b"\\n\\n"
USAGE = {"prompt_tokens": 10, "completion_tokens": EVENTS, "total_tokens": EVENTS + 10}
LAST = b"data: " + json.dumps({**BASE, "choices": [], "usage": USAGE}).encode() + b"\\n\\n"
BODY = json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode()

async def handle(request):
    body = await request.json()
    if not body.get("stream"):
        return web.Response(
            body=BODY, content_type="application/json", headers={"X-Tokens": str(EVENTS + 10)}
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(EVENTS):
        await response.write(CHUNK)
    await response.write(LAST + b"data: [DONE]\\n\\n")
    await response.write_eof()
    return response

app = web.Application()
app.router.add_post("/v1/chat/completions", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

POLICY = """version: 1
server:
  listen: 127.0.0.1:{port}
  admin_listen: 127.0.0.1:{admin}
upstreams:
  llm:
    url: http://127.0.0.1:{upstream}
routes:
  - name: llm
    upstream: llm
"""
LIMITS = {
    "none": "",
    "cost_from": (
        "limits:\n  tokens:\n    algorithm: fixed_window\n    limit: 1000000000000\n"
        "    window: 1h\n    key: [global]\n    cost_from: openai\n    reserve: 2000\n"
    ),
    "cost_header": (
        "limits:\n  tokens:\n    algorithm: fixed_window\n    limit: 1000000000000\n"
        "    window: 1h\n    key: [global]\n    cost_header: X-Tokens\n    reserve: 2000\n"
    ),
}


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
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


async def fetch(url: str, calls: int, stream: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    connector = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, resp.status
                async for _ in resp.content.iter_chunked(65536):
                    pass

        for start_at in range(0, calls, 4):
            await asyncio.gather(*[one() for _ in range(min(4, calls - start_at))])


async def wait_open(url: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            await fetch(url, 1, False)
            return
        except (aiohttp.ClientError, OSError, AssertionError):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer within {within_s}s") from None
            await asyncio.sleep(0.2)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200, help="streams per run")
    parser.add_argument("--calls", type=int, default=2000, help="non-streamed calls per run")
    parser.add_argument("--events", type=int, default=1000, help="events per stream")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up = free_port()
        procs.append(
            start([sys.executable, "-c", UPSTREAM, str(up), str(args.events)], tmp / "up.log")
        )
        gateways: dict[str, tuple[str, int]] = {}
        for name, limits in LIMITS.items():
            port, admin = free_port(), free_port()
            policy = tmp / f"{name}.yaml"
            policy.write_text(POLICY.format(port=port, admin=admin, upstream=up) + limits)
            cmd = [sys.executable, "-m", "gateway", "run", "-c", str(policy), "--workers", "1"]
            procs.append(start(cmd, tmp / f"{name}.log"))
            gateways[name] = (f"http://127.0.0.1:{port}", procs[-1].pid)
        for url, _ in gateways.values():
            await wait_open(url)
        streamed: dict[str, list[float]] = {"none": [], "cost_header": [], "cost_from": []}
        whole: dict[str, list[float]] = {"cost_header": [], "cost_from": []}
        for round_ in range(args.repeats):
            for name in streamed:
                url, pid = gateways[name]
                before = group_cpu_s(pid)
                await fetch(url, args.streams, True)
                streamed[name].append((group_cpu_s(pid) - before) * 1e6 / args.streams)
            for name in whole:
                url, pid = gateways[name]
                before = group_cpu_s(pid)
                await fetch(url, args.calls, False)
                whole[name].append((group_cpu_s(pid) - before) * 1e6 / args.calls)
            print(f"round {round_ + 1}: {streamed} {whole}", file=sys.stderr)
        med = {name: statistics.median(v) for name, v in streamed.items()}
        print(
            f"\nstreamed ({args.events} events), gateway CPU per stream, medians of "
            f"{args.repeats}: no limit {med['none']:.0f} µs, cost_from {med['cost_from']:.0f} µs: "
            f"+{(med['cost_from'] / med['none'] - 1) * 100:.1f} % (a cost_header limit, the "
            f"stream unread: {med['cost_header']:.0f} µs)"
        )
        med = {name: statistics.median(v) for name, v in whole.items()}
        print(
            f"non-streamed, gateway CPU per call: cost_header {med['cost_header']:.1f} µs, "
            f"cost_from {med['cost_from']:.1f} µs: "
            f"{(med['cost_from'] / med['cost_header'] - 1) * 100:+.1f} %"
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
