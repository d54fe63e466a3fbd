"""Where a request waits inside one gateway worker: the timings behind bench/README.md's
"Fairness at 256 connections".

``run`` starts ``gateway run --workers 1`` (in this process) with timers added
to the listener's protocol and the proxy handler, and writes their histograms to ``--out``
once a second; ``show`` prints them. Pure build only (it wraps the handler's methods, which
the compiled build cannot). Measured, in milliseconds:

- ``accept_to_first``: a connection accepted (``connection_made``) to its first request queued;
- ``arrive_to_handler``: a request queued by ``data_received`` to the handler's start;
- ``handler``: the handler, the upstream leg included;
- ``finish_to_next``: a response's end to the next request queued on that connection (the
  client's side and the kernel's);
- ``gc``: each collection; ``loop_gap``: a 1 ms sleep's actual length;
- ``accepts``: when each connection was accepted (``show`` prints each burst's spread).

    python bench/fairness_trace.py run --out trace.json --config P --listen 127.0.0.1:8080
    (``--root DIR``: the gateway of another checkout)
    wrk -t2 -c256 -d5s --latency http://127.0.0.1:8080/
    python bench/fairness_trace.py show trace.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
SERIES = ("accept_to_first", "arrive_to_handler", "handler", "finish_to_next", "gc", "loop_gap")
BURST_GAP_S = 1.0  # accepts further apart than this start a new burst


class Trace:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.counts = {name: [0] * (len(BUCKETS_MS) + 1) for name in SERIES}
        self.max_ms = dict.fromkeys(SERIES, 0.0)
        self.accepts: list[float] = []
        self.accepted: dict[object, float] = {}
        self.arrived: dict[object, float] = {}
        self.finished: dict[object, float] = {}
        self._gc_started = 0.0

    def note(self, name: str, ms: float) -> None:
        self.counts[name][bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.max_ms[name] = max(self.max_ms[name], ms)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = perf_counter()
        else:
            self.note("gc", (perf_counter() - self._gc_started) * 1000)

    async def write_every_second(self) -> None:
        last = perf_counter()
        next_write = last + 1.0
        while True:
            await asyncio.sleep(0.001)
            now = perf_counter()
            self.note("loop_gap", (now - last) * 1000)
            last = now
            if now >= next_write:
                next_write = now + 1.0
                document = {"buckets_ms": BUCKETS_MS, "counts": self.counts}
                document |= {"max_ms": self.max_ms, "accepts": self.accepts}
                self.out.write_text(json.dumps(document))


def instrument(trace: Trace) -> None:
    from gateway.edge import proxy, server

    protocol = server.GatewayProtocol
    made, received = protocol.connection_made, protocol.data_received
    call = proxy.ProxyHandler.__call__

    def connection_made(self: Any, transport: Any) -> None:
        now = perf_counter()
        trace.accepts.append(now)
        trace.accepted[self] = now
        made(self, transport)

    def data_received(self: Any, data: bytes) -> None:
        queued = len(self._messages)
        received(self, data)
        if len(self._messages) <= queued:
            return
        now = perf_counter()
        trace.arrived[self] = now
        if (accepted := trace.accepted.pop(self, None)) is not None:
            trace.note("accept_to_first", (now - accepted) * 1000)
        if (finished := trace.finished.get(self)) is not None:
            trace.note("finish_to_next", (now - finished) * 1000)

    started = [False]

    async def handle(self: Any, request: Any) -> Any:
        begun = perf_counter()
        if (arrived := trace.arrived.get(request.protocol)) is not None:
            trace.note("arrive_to_handler", (begun - arrived) * 1000)
        if not started[0]:
            started[0] = True
            asyncio.get_running_loop().create_task(trace.write_every_second())
        try:
            return await call(self, request)
        finally:
            ended = perf_counter()
            trace.note("handler", (ended - begun) * 1000)
            trace.finished[request.protocol] = ended

    protocol.connection_made = connection_made  # type: ignore[method-assign]
    protocol.data_received = data_received  # type: ignore[method-assign]
    proxy.ProxyHandler.__call__ = handle  # type: ignore[method-assign]
    gc.callbacks.append(trace.on_gc)


def show(path: Path) -> None:
    document = json.loads(path.read_text())
    bounds = [*document["buckets_ms"], float("inf")]
    for name, counts in document["counts"].items():
        total = sum(counts)
        if not total:
            continue
        seen, quantiles = 0, {}
        for bound, count in zip(bounds, counts, strict=True):
            seen += count
            for q in (0.5, 0.99, 0.999):
                if q not in quantiles and seen >= q * total:
                    quantiles[q] = bound
        print(
            f"{name:<18} n={total:<7} p50<={quantiles[0.5]:g} p99<={quantiles[0.99]:g} "
            f"p99.9<={quantiles[0.999]:g} max {document['max_ms'][name]:.1f} ms"
        )
    accepts = document["accepts"]
    bursts: list[list[float]] = []
    for when in accepts:
        if bursts and when - bursts[-1][-1] < BURST_GAP_S:
            bursts[-1].append(when)
        else:
            bursts.append([when])
    for burst in bursts:
        spread = [(when - burst[0]) * 1000 for when in burst]
        print(
            f"accepts: a burst of {len(burst)} over {spread[-1]:.0f} ms "
            f"(half accepted by {spread[len(spread) // 2]:.0f} ms)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the gateway with the timers")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument(
        "--root", type=Path, default=REPO_ROOT, help="the checkout whose gateway to run"
    )
    run.add_argument("--config", required=True, help="the policy file")
    run.add_argument("--listen", required=True, help="HOST:PORT of the proxy listener")
    run.add_argument("--admin-listen", default="127.0.0.1:0", help="HOST:PORT of the admin side")
    shown = commands.add_parser("show", help="print a trace")
    shown.add_argument("trace", type=Path)
    args = parser.parse_args(argv)
    if args.command == "show":
        show(args.trace)
        return 0
    gateway_args = ["--config", args.config, "--listen", args.listen, "--workers", "1"]
    gateway_args += ["--admin-listen", args.admin_listen]
    sys.path.insert(0, str(args.root.resolve()))
    instrument(Trace(args.out))
    from gateway.cli.main import main as gateway_main

    return gateway_main(["run", *gateway_args])


if __name__ == "__main__":
    sys.exit(main())
