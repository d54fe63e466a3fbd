"""Command-line behaviour that does not need a running gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_several_workers_with_in_process_limits_are_refused() -> None:
    result = _gateway("run", "--config", "policies/default.yaml", "--workers", "2")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "gateway: 2 workers with in-process limit state would enforce every limit once per "
        "worker; use a shared store (Redis) or run one worker"
    )


def test_run_without_a_policy_says_what_to_give() -> None:
    result = _gateway("run")
    assert result.returncode == 1
    assert "use --config FILE (or GATEWAY_CONFIG), or --upstream URL" in result.stderr


def test_run_refuses_an_invalid_policy_with_its_line() -> None:
    bad = ROOT / "tests" / "fixtures" / "invalid" / "bad_listen.yaml"
    result = _gateway("run", "--config", str(bad))
    assert result.returncode == 1
    assert f"{bad}:2: server.listen: invalid listen address 'localhost'" in result.stderr
