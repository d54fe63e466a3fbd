"""The capacity-C test upstream (bench/capacity_upstream.py) as a real process, for the tests
that put it behind the gateway or offer it load (bench/offered_load.py)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"


@contextlib.contextmanager
def capacity_upstream(capacity: int = 8, service_ms: float = 20.0) -> Iterator[str]:
    """Its base URL (loopback, a free port) while it runs; stopped with SIGTERM after."""
    process = subprocess.Popen(
        [sys.executable, str(BENCH / "capacity_upstream.py"), "--port", "0",
         "--capacity", str(capacity), "--service-ms", str(service_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r":(\d+)$", line.strip())
        assert match, f"the capacity upstream did not start: {line!r}"
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
