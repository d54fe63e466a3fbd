"""The opt-in loop-lag probe: off by default, and what it writes when on."""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest

from gateway.observability.loop_lag import (
    BUCKETS_MS,
    ENV_FILE,
    LoopLagProbe,
    probe_from_environment,
)


def test_off_unless_the_variable_names_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FILE, raising=False)
    assert probe_from_environment(1) is None


class _Kept(io.StringIO):
    """Keeps its text after ``close`` (the probe closes its file when stopped)."""

    def close(self) -> None:
        self.kept = self.getvalue()
        super().close()


async def test_a_blocked_loop_shows_as_lag_in_the_line_of_its_second() -> None:
    out = _Kept()
    probe = LoopLagProbe(out, worker_id=3)
    probe.start()
    probe.note_tick(0.0004, 0.0003)
    await asyncio.sleep(0.05)
    time.sleep(0.03)  # noqa: ASYNC251  (the loop held for 30 ms, as a long callback would)
    # Its line is written once the wall-clock second ends: poll for it, 3 s at most.
    deadline = time.monotonic() + 3.0
    while '"max_ms":3' not in out.getvalue() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    await probe.stop()
    lines = out.kept.splitlines()
    assert lines, "no line within 3 s"
    records = [json.loads(line) for line in lines]
    assert all(r["worker"] == 3 and len(r["counts"]) == len(BUCKETS_MS) + 1 for r in records)
    assert max(r["max_ms"] for r in records) >= 25.0
    assert max(r["tick_max_ms"] for r in records) == pytest.approx(0.4)
    assert max(r["tick_cpu_max_ms"] for r in records) == pytest.approx(0.3)
