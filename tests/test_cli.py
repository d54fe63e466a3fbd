"""Command-line behaviour that does not need a running gateway."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
LOOPBACK = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")


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
        "gateway: --workers 2: 2 workers with in-process limit state would enforce every limit "
        "once per worker; use a shared store (Redis) or run one worker"
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


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "invalid").iterdir()))
def test_check_and_run_refuse_every_invalid_fixture_alike(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What check refuses, run refuses with the same lines, and the other way round."""
    path = str(FIXTURES / "invalid" / name)
    assert main(["check", path]) == 1
    refused = capsys.readouterr().err.strip()
    assert refused.startswith(path)
    with pytest.raises(SystemExit) as info:
        main(["run", "--config", path, *LOOPBACK])
    assert info.value.code == refused


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "valid").iterdir()))
def test_check_and_run_accept_every_valid_fixture_alike(name: str, tmp_path: Path) -> None:
    path = str(FIXTURES / "valid" / name)
    assert _gateway("check", path).returncode == 0
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", path, *LOOPBACK],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def test_a_limit_too_large_for_redis_is_one_line_from_run_not_a_traceback() -> None:
    path = FIXTURES / "invalid" / "redis_limit_too_large.yaml"
    result = _gateway("run", "--config", str(path), *LOOPBACK)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{path}:10: limits.huge: (2 * limit + 1) * window")
