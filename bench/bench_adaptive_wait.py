"""Micro-benchmark: what waiting for a place at the adaptive limit costs (``AdaptiveGate``).

``--tasks`` tasks pass through one gate, each in turn: a place (``try_enter``, else ``enter``),
one turn of the event loop holding it (the upstream's), ``release``. With ``--limit`` below the
tasks, most passes wait in the line; with the limit at the tasks, none waits, which is the cost
of the rest (the loop's turn, the controller). The gate's limit is fixed (``min_limit`` =
``max_limit``) and nothing times out (``max_delay`` 5 s, the ``gw-adaptive`` bench's). Each
figure is the best of ``--repeat`` rounds of process CPU time over ``--passes`` passes.
``--root`` imports ``gateway`` from another checkout (built or not), for a before/after.

    python bench/bench_adaptive_wait.py [--root DIR] [--loop uvloop|asyncio] [--limit 4]
        [--tasks 32] [--passes 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="what waiting at the adaptive limit costs")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--passes", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    return parser.parse_args()


async def passes(limit: int, tasks: int, count: int) -> float:
    """CPU seconds for ``count`` passes of ``tasks`` tasks through a gate of ``limit`` places."""
    from gateway.algorithms.gradient_limit import GradientParams
    from gateway.clock import MonotonicClock
    from gateway.edge.adaptive_gate import AdaptiveGate

    params = GradientParams(
        min_limit=limit,
        max_limit=limit,
        buffer=0.2,
        min_buffer_us=1000,
        sample_interval_us=100_000,
        probe_interval_us=60_000_000,
        probe_requests=10,
        jitter=0.0,
    )
    gate = AdaptiveGate(params, MonotonicClock(), lambda: 0.0, max_delay_s=5.0, max_queue=1000)
    left = count

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if not gate.try_enter() and not await gate.enter():
                raise AssertionError("shed: nothing should time out here")
            started_us = gate.now_us()
            await asyncio.sleep(0)  # the upstream's turn
            gate.release(started_us, measured=False)

    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(tasks)))
    return time.process_time() - started


def main() -> None:
    args = parse()
    sys.path.insert(0, str(args.root.resolve()))
    from gateway.build import build_name

    run = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    print(f"gateway from {args.root} ({build_name()}), {args.loop}, {args.tasks} tasks")
    for limit in (args.limit, args.tasks):
        best = min(run(passes(limit, args.tasks, args.passes)) for _ in range(args.repeat))
        print(f"  limit {limit:>4}: {best / args.passes * 1e6:6.2f} us of CPU per pass")


if __name__ == "__main__":
    main()
