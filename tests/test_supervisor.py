"""The supervisor of ``gateway run --workers N``: its workers never outlive it, and no second
gateway starts on an address another still holds.

Real gateway processes (the CLI's supervisor and its forked workers) in front of a real
upstream, a real HTTP client over loopback; the supervisor is killed with SIGKILL, as the
OOM killer or an operator's ``kill -9`` would. Admissions are counted per window from both
generations' access logs (``t_us``: the limiter's clock, the monotonic clock set to the wall
clock when each gateway starts, so both generations' windows are whole seconds of the wall
clock).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from tests.support.network import free_port
from tests.support.processes import alive, children, spawn
from tests.support.upstreams import RecordingUpstream

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

LIMIT = 100
WINDOW_LIMIT = f"""\
limits:
  global:
    algorithm: fixed_window
    limit: {LIMIT}
    window: 1s
    key: [global]
"""


class Generation:
    """One ``gateway run --workers 2`` with its log."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.tmp_path = tmp_path
        self.log = tmp_path / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.workers: list[int] = []

    async def start(self) -> asyncio.subprocess.Process:
        argv = ["-m", "gateway", "run", "--config", str(self.tmp_path / "policy.yaml")]
        env = {
            "GATEWAY_METRICS_DIR": str(self.tmp_path / "metrics"),
            "GATEWAY_SHARED_DIR": str(self.tmp_path / "shared"),
        }
        self.proc = await spawn([*argv, "--workers", "2"], self.log, env)
        return self.proc

    async def serving(self, within_s: float = 60.0) -> list[int]:
        """Both workers serving; their pids."""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while loop.time() < deadline:
            text = self.log.read_text()
            if "worker 0 serving" in text and "worker 1 serving" in text:
                self.workers = children(self.proc.pid)
                return self.workers
            assert self.proc.returncode is None, text
            await asyncio.sleep(0.1)
        raise AssertionError(f"not serving within {within_s}s: {self.log.read_text()}")

    def admitted_per_window(self) -> Counter[int]:
        counted: Counter[int] = Counter()
        for line in self.log.read_text().splitlines():
            if line.startswith("{") and '"t_us"' in line:
                entry = json.loads(line)
                if entry["status"] == 200:
                    counted[entry["t_us"] // 1_000_000] += 1
        return counted

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL for any of its workers still there (orphans too)."""
        try:
            if self.proc is not None and self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(self.proc.wait(), 30)
        finally:
            for pid in self.workers:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


async def paced_load(url: str, per_s: int, stop: asyncio.Event, most: int) -> Counter[int | str]:
    """GETs at ``per_s`` a second, each on a new connection (so both workers get some),
    until ``stop`` or ``most`` requests; the statuses, or the error's name."""
    statuses: Counter[int | str] = Counter()
    timeout = aiohttp.ClientTimeout(total=10)
    connector = aiohttp.TCPConnector(force_close=True, limit=200)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one() -> None:
            try:
                async with session.get(url + "/x") as resp:
                    await resp.read()
                    statuses[resp.status] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[type(exc).__name__] += 1

        loop = asyncio.get_running_loop()
        started, sent, tasks = loop.time(), 0, []
        while not stop.is_set() and sent < most:
            tasks.append(loop.create_task(one()))
            sent += 1
            await asyncio.sleep(max(0.0, started + sent / per_s - loop.time()))
        await asyncio.gather(*tasks)
    return statuses


async def test_workers_stop_with_a_killed_supervisor_and_no_second_gateway_starts_beside_them(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """A second ``run`` on the same addresses while a gateway runs is refused in one line;
    the supervisor SIGKILLed under 400 requests a second, its workers stop; a new gateway then
    starts on the same addresses. No window admits more than the limit across both."""
    port, admin_port = free_port(), free_port()
    (tmp_path / "policy.yaml").write_text(
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        "  access_log: true\n  access_log_format: json\n"
        # A connection accepted as the listener closes may wait for its header deadline
        # before a stopping worker lets go of it (aiohttp's shutdown): 2 s, not 10.
        "  header_timeout: 2s\n"
        f"upstreams:\n  backend:\n    url: {upstream.url}\n"
        "routes:\n  - name: all\n    upstream: backend\n" + WINDOW_LIMIT
    )
    first, second, third = (Generation(tmp_path, name) for name in ("first", "second", "third"))
    stop = asyncio.Event()
    load = None
    try:
        supervisor = await first.start()
        workers = await first.serving()
        assert len(workers) == 2

        refused = await second.start()
        assert await asyncio.wait_for(refused.wait(), 60) != 0
        output = second.log.read_text()
        assert output.count("\n") == 1 and "Traceback" not in output, output
        holders = ", ".join(map(str, sorted([supervisor.pid, *workers])))
        assert output == (
            f"gateway: cannot listen on 127.0.0.1:{port} (proxy): another gateway still runs "
            f"there (pid {holders}); stop it first\n"
        )

        load = asyncio.ensure_future(paced_load(f"http://127.0.0.1:{port}", 400, stop, 20_000))
        await asyncio.sleep(2.0)
        os.kill(supervisor.pid, signal.SIGKILL)
        await supervisor.wait()
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        while any(alive(pid) for pid in workers):
            assert loop.time() < killed_at + 15, "the workers outlived their supervisor"
            await asyncio.sleep(0.05)
        gone_after_s = loop.time() - killed_at
        # The new gateway starts with fresh state: in the window the old workers died in it
        # could admit a whole limit more, by design. It starts in the next window (the limit's
        # windows are whole seconds of the wall clock, as the gateway's clock is set to it at
        # start; not of the monotonic clock, whose seconds fall anywhere in them), so every
        # window shows one gateway.
        await asyncio.sleep(1.0 - time.time() % 1.0 + 0.01)

        await third.start()
        await third.serving()
        await asyncio.sleep(2.0)
        stop.set()
        statuses = await load
    finally:
        stop.set()
        if load is not None:
            await asyncio.gather(load, return_exceptions=True)
        for generation in (third, second, first):
            await generation.stop()
    windows = first.admitted_per_window() + third.admitted_per_window()
    print(
        f"\nworkers gone {gone_after_s:.2f} s after the supervisor's SIGKILL; statuses "
        f"{dict(statuses)}; admitted per window {sorted(windows.values(), reverse=True)[:6]}"
    )
    assert max(windows.values()) <= LIMIT, windows
    assert 0 < statuses[200] <= sum(windows.values())
    assert not {status for status in statuses if isinstance(status, int)} - {200, 429}
    # The killed gateway's state directory was removed by the new one, its workers gone.
    assert not (tmp_path / "shared" / f"gateway-limits-{supervisor.pid}").exists()
