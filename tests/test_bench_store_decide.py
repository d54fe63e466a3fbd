"""bench/bench_store_decide.py and bench/bench_redis_instructions.py run where CI runs (smoke
tests, not measurements): one kind at one and several callers, with Redis's whole CPU and the
round trips per decision beside the script's own time; Redis's instructions per decision."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import redis_harness
from tests.support.redis_harness import RedisFactory

REPO_ROOT = Path(__file__).parent.parent
BENCH = REPO_ROOT / "bench" / "bench_store_decide.py"

redis_factory = redis_harness.redis_factory


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _redis_row(stdout: str, name: str) -> list[str]:
    """The cells of the Redis table's row for ``name``."""
    rows = [line for line in stdout.splitlines() if line.startswith(f"| {name} |")]
    assert rows, stdout
    return [cell.strip() for cell in rows[-1].strip("|").split("|")]


def test_one_caller_makes_a_round_trip_per_decision_and_several_share_them(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory.start()
    result = _run(
        "--redis", server.url, "--kinds", "redis", "--callers", "1,8", "--decides", "64",
        "--rounds", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Redis CPU µs / decide (whole process) | round trips / decide |" in result.stdout
    alone = _redis_row(result.stdout, "redis, 1 callers")
    together = _redis_row(result.stdout, "redis, 8 callers")
    assert alone[1] == together[1] == "1.000"  # one script call per decision
    assert alone[5] == "1.000"
    assert float(together[5]) <= 1.0
    assert float(alone[4]) > 0 and float(together[4]) > 0


def test_an_unknown_kind_is_refused_with_the_known_ones() -> None:
    result = _run("--kinds", "redis,mongo", "--decides", "64", "--rounds", "1")
    assert result.returncode == 2
    assert "unknown kinds mongo: pick of memory, redis," in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (callgrind)")
def test_redis_instructions_are_counted_in_all_and_in_the_script() -> None:
    """bench_redis_instructions.py, the same decisions counted under callgrind."""
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_redis_instructions.py"),
         "--decides", "64", "--callers", "1,4"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for callers in (1, 4):
        rows = [line for line in result.stdout.splitlines() if line.startswith("| this |")]
        cells = [cell.strip() for cell in rows[0 if callers == 1 else 1].strip("|").split("|")]
        assert cells[1] == str(callers)
        total, script = (int(cell.replace(",", "")) for cell in cells[2:4])
        assert 0 < script < total
