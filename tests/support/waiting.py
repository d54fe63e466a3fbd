"""Bounded waits: for something the event loop or another process will make true, and for a
process to answer on a URL. Every wait has a deadline and says what it waited for."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp


async def wait_until(
    condition: Callable[[], object] | Callable[[], Awaitable[object]],
    what: str = "the condition",
    within_s: float = 5.0,
    every_s: float = 0.02,
    context: Callable[[], str] | None = None,
) -> None:
    """Until ``condition()`` (a plain or an async callable) is true; an AssertionError naming
    ``what`` (and ``context()``, say a process's log) once ``within_s`` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            found = f":\n{context()}" if context is not None else ""
            raise AssertionError(f"timed out after {within_s}s waiting for {what}{found}")
        await asyncio.sleep(every_s)


class Watched(Protocol):
    """A process a test started: whether it still runs, and what it wrote."""

    @property
    def proc(self) -> asyncio.subprocess.Process: ...

    def log(self) -> str: ...


async def wait_for_status(
    process: Watched, url: str, status: int = 200, within_s: float = 20.0
) -> None:
    """Until ``url`` answers ``status``; fails at once, with the process's output, if it
    exits first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while loop.time() < deadline:
            if process.proc.returncode is not None:
                raise AssertionError(f"exited early:\n{process.log()}")
            try:
                async with session.get(url) as resp:
                    if resp.status == status:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {within_s}s:\n{process.log()}")
