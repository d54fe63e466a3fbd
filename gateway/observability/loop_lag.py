"""An opt-in event-loop lag probe, for benchmarks: how late the loop runs a periodic timer.

Off unless ``GATEWAY_LOOP_LAG_FILE`` names a file. Then a task sleeps ``INTERVAL_S`` at a time
and records how much later than asked it woke (the time the loop spent on other work it could
not interrupt), and how long each once-a-second observability tick took. Once a second it
appends one JSON line per worker to the file: the second, the lag histogram of that second
(counts per bucket of ``BUCKETS_MS``), its largest lag and the longest tick, in wall time and in
this thread's CPU time (on a busy machine a tick's wall time includes time the process waited
for a core; its CPU time is the work the tick itself did). A reader adds up
the lines of the seconds it cares about (``bench/bench_proxy.py`` does, per load run).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import time
from typing import TextIO

ENV_FILE = "GATEWAY_LOOP_LAG_FILE"
INTERVAL_S = 0.005
# Upper bounds of the histogram buckets, in milliseconds; a last bucket holds the rest.
BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0)


class LoopLagProbe:
    """Records timer lateness on the running loop and the ticks' durations; see module doc."""

    def __init__(self, out: TextIO, worker_id: int) -> None:
        self._out = out
        self._worker = worker_id
        self._counts = [0] * (len(BUCKETS_MS) + 1)
        self._max_ms = 0.0
        self._tick_max_ms = 0.0
        self._tick_cpu_max_ms = 0.0
        self._tick_cpu_max_ms = 0.0
        self._task: asyncio.Task[None] | None = None

    def note_tick(self, seconds: float, cpu_seconds: float) -> None:
        """How long one once-a-second observability tick held the loop, and its CPU time."""
        self._tick_max_ms = max(self._tick_max_ms, seconds * 1000.0)
        self._tick_cpu_max_ms = max(self._tick_cpu_max_ms, cpu_seconds * 1000.0)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._out.close()

    async def _run(self) -> None:
        clock = time.monotonic
        second = int(time.time())
        while True:
            asked = clock() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            lag_ms = max(0.0, (clock() - asked) * 1000.0)
            self._counts[bisect.bisect_left(BUCKETS_MS, lag_ms)] += 1
            if lag_ms > self._max_ms:
                self._max_ms = lag_ms
            now_second = int(time.time())
            if now_second != second:
                self._flush(second)
                second = now_second

    def _flush(self, second: int) -> None:
        record = {
            "second": second,
            "worker": self._worker,
            "counts": self._counts,
            "max_ms": round(self._max_ms, 3),
            "tick_max_ms": round(self._tick_max_ms, 3),
            "tick_cpu_max_ms": round(self._tick_cpu_max_ms, 3),
        }
        self._out.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._out.flush()
        self._counts = [0] * (len(BUCKETS_MS) + 1)
        self._max_ms = 0.0
        self._tick_max_ms = 0.0
        self._tick_cpu_max_ms = 0.0


def probe_from_environment(worker_id: int) -> LoopLagProbe | None:
    """A probe writing to the file ``GATEWAY_LOOP_LAG_FILE`` names, or ``None`` if unset."""
    path = os.environ.get(ENV_FILE)
    if not path:
        return None
    return LoopLagProbe(open(path, "a", encoding="utf-8"), worker_id)
