"""Reading the logs, driving one simulation (or two, side by side), and the progress line."""

from __future__ import annotations

import contextlib
import gc
import heapq
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Final

from gateway.replay.log_formats import (
    LogError,
    Opened,
    ReadStats,
    Request,
    close_log,
    in_time_order,
    open_log,
    read_log,
)
from gateway.replay.simulate import REJECTED, Simulation

# The cyclic collector's thresholds while lines are decided. A line's objects are freed by
# their reference counts (a replay of the example policies leaves no cycles), so its passes,
# over the records waiting in the reorder window above all, are cost for nothing; cycles, if
# a policy makes some, are still collected, only less often.
_REPLAY_GC_THRESHOLDS: Final[tuple[int, int, int]] = (50_000, 20, 100)


@dataclass
class Changes:
    """Clients whose requests fare differently under the candidate than under the current."""

    newly_rejected: Counter[str] = field(default_factory=Counter)
    newly_admitted: Counter[str] = field(default_factory=Counter)
    requests_newly_rejected: int = 0
    requests_newly_admitted: int = 0


@dataclass
class Run:
    stats: ReadStats
    simulations: list[Simulation]
    changes: Changes | None
    elapsed_s: float


class Progress:
    """A one-line progress bar on a terminal (stderr); nothing when it is not one.

    The logs are read side by side (merged in time order), so the bar is the bytes read of
    all of them over their total."""

    def __init__(
        self, stream: IO[str] | None, total_bytes: int | None, logs: Sequence[Opened]
    ) -> None:
        self.stream = stream
        self.total = total_bytes
        self.logs = logs
        self.started = time.monotonic()
        self.last_draw = self.started - 1.0  # the first tick draws at once

    def position(self) -> int:
        """Bytes read so far, of every log."""
        read = 0
        for log in self.logs:
            with contextlib.suppress(OSError, ValueError):  # a pipe, or a log already closed
                read += log.raw.tell()
        return read

    def tick(self, requests: int) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if now - self.last_draw < 0.25:
            return
        self.last_draw = now
        rate = requests / max(now - self.started, 1e-9)
        text = f"replay: {requests:,} requests, {rate:,.0f}/s"
        if self.total:
            fraction = min(1.0, self.position() / self.total)
            bar = "#" * int(fraction * 30)
            text = f"[{bar:<30}] {fraction:4.0%} " + text
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


async def replay(
    paths: Sequence[str],
    simulations: list[Simulation],
    *,
    fmt: str = "auto",
    window_us: int = 30_000_000,
    show_progress: bool | None = None,
) -> Run:
    """Every request of every log, in time order (each log reordered within ``window_us``,
    then merged), through each simulation. Raises ``LogError`` for a log that cannot be read."""
    stats = ReadStats()
    opened: list[Opened] = []
    try:
        for path in paths:
            opened.append(open_log(path))
    except LogError:
        for item in opened:
            close_log(item)
        raise
    total = None if any(o.size is None for o in opened) else sum(o.size or 0 for o in opened)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    progress = Progress(sys.stderr if show_progress else None, total, opened)
    try:
        streams = [in_time_order(read_log(o, fmt, stats), window_us, stats) for o in opened]
    except LogError:
        for item in opened:
            close_log(item)
        raise
    merged: Iterator[Request] = (
        streams[0] if len(streams) == 1 else heapq.merge(*streams, key=lambda r: r.t_us)
    )
    changes = Changes() if len(simulations) == 2 else None
    first = simulations[0]
    started = time.perf_counter()
    count = 0
    thresholds = gc.get_threshold()
    gc.set_threshold(*_REPLAY_GC_THRESHOLDS)
    try:
        for request in merged:
            count += 1
            if count & 0xFFF == 0:
                progress.tick(count)
            elif count == 1 and stats.unix_offset_us is not None:
                # The log's instants are on the gateway's monotonic clock: calendar windows
                # read calendar time, that far apart.
                for simulation in simulations:
                    simulation.clock.unix_offset_us = stats.unix_offset_us
            client_ip = first.client_ip(request)
            outcome = first.decide(request, client_ip)
            if changes is not None:
                current = simulations[1]
                before = current.decide(request, current.client_ip(request))
                if outcome == REJECTED and before != REJECTED:
                    changes.newly_rejected[client_ip] += 1
                    changes.requests_newly_rejected += 1
                elif before == REJECTED and outcome != REJECTED:
                    changes.newly_admitted[client_ip] += 1
                    changes.requests_newly_admitted += 1
    finally:
        gc.set_threshold(*thresholds)
        progress.close()
        for item in opened:
            close_log(item)
    for simulation in simulations:
        simulation.finish()
    return Run(stats, simulations, changes, time.perf_counter() - started)
