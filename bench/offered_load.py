"""Open-loop load: requests sent at a rate, whatever happens to the earlier ones.

A closed loop (N clients, each sending when its last answer came) slows down with the server and
hides overload; an overloaded upstream is what the adaptive limit is for, so its tests and
bench/adaptive_curves.py offer a Poisson stream at a fixed rate instead and record every
request's fate. Bounded: at most ``max_in_flight`` requests outstanding (arrivals beyond are
counted as ``dropped``, not sent), and the run stops at ``duration_s``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class Sent:
    """One request: when it left (seconds since the run began), how long its answer took,
    its status (0: no answer, the connection failed) and its Retry-After, if any."""

    at_s: float
    latency_s: float
    status: int
    retry_after: str | None


@dataclass
class Offered:
    sent: list[Sent] = field(default_factory=list)
    dropped: int = 0  # arrivals not sent: max_in_flight were outstanding

    def between(self, start_s: float, end_s: float, status: int | None = None) -> list[Sent]:
        """Requests that left in ``[start_s, end_s)`` (with that status, if given)."""
        return [
            s
            for s in self.sent
            if start_s <= s.at_s < end_s and (status is None or s.status == status)
        ]


async def offer(
    url: str,
    rate_per_s: float,
    duration_s: float,
    *,
    seed: int = 0,
    max_in_flight: int = 2000,
    timeout_s: float = 30.0,
) -> Offered:
    """Send GETs to ``url`` as a Poisson stream of ``rate_per_s`` for ``duration_s``."""
    rng = random.Random(seed)
    result = Offered()
    connector = aiohttp.TCPConnector(limit=max_in_flight, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    in_flight: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin = time.monotonic()

        async def one(at_s: float) -> None:
            started = time.monotonic()
            status, retry_after = 0, None
            try:
                async with session.get(url) as response:
                    await response.read()
                    status, retry_after = response.status, response.headers.get("Retry-After")
            except (TimeoutError, aiohttp.ClientError):
                pass
            result.sent.append(Sent(at_s, time.monotonic() - started, status, retry_after))

        due_s = rng.expovariate(rate_per_s)
        while due_s < duration_s:
            delay = begin + due_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= max_in_flight:
                result.dropped += 1
            else:
                task = asyncio.ensure_future(one(due_s))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            due_s += rng.expovariate(rate_per_s)
        if in_flight:
            await asyncio.wait(in_flight)
    result.sent.sort(key=lambda s: s.at_s)
    return result
