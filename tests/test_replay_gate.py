"""``gateway replay --fail-if``: a replay as a CI gate, on a log whose counts are known by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.replay.gate import GateError, parse_condition
from tests.support.policies import policy_for
from tests.support.traffic_logs import combined_line

ROOT = Path(__file__).resolve().parent.parent
# rate 1r/s, burst 2: the fourth request of a second (spread to 0, 250, 500, 750 ms) passes
# the burst (excess 2250 > 2000) and is rejected; the rest are admitted.
NGINX_NODELAY = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n    nodelay: true\n"
)


def write_policy(tmp_path: Path, limits: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for("http://127.0.0.1:9") + "limits:\n" + limits)
    return path


def burst_log(tmp_path: Path) -> Path:
    """Ten requests: four of 203.0.113.1 in second 0, one of 203.0.113.2 a second for four
    seconds, two of 203.0.113.1 in second 5: one rejected under ``NGINX_NODELAY``."""
    lines = [combined_line("203.0.113.1", 0) for _ in range(4)]
    lines += [combined_line("203.0.113.2", s) for s in range(1, 5)]
    lines += [combined_line("203.0.113.1", 5) for _ in range(2)]
    log = tmp_path / "access.log"
    log.write_text("".join(lines))
    return log


def gate(tmp_path: Path, capsys: pytest.CaptureFixture[str], *conditions: str) -> tuple[int, str]:
    # burst_log under NGINX_NODELAY: 10 requests, 1 rejected (10%), none delayed.
    policy = write_policy(tmp_path, NGINX_NODELAY)
    args = ["replay", "--no-progress", "--config", str(policy), str(burst_log(tmp_path))]
    for condition in conditions:
        args += ["--fail-if", condition]
    status = main(args)
    return status, capsys.readouterr().err


def test_a_condition_met_fails_the_replay_naming_the_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = gate(tmp_path, capsys, "rejected > 5%", "delayed > 0")
    assert status == 1
    assert err.splitlines() == ["gateway replay: failed: --fail-if rejected > 5%: 10.00% (1 of 10)"]


def test_conditions_not_met_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = gate(tmp_path, capsys, "rejected > 10%", "rejected >= 2", "per_ip.rejected > 10%")
    assert (status, err) == (0, "")


def test_a_limits_share_is_of_the_requests_it_decided(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = gate(tmp_path, capsys, "per_ip.rejected >= 10%", "per_ip.delayed == 0")
    assert status == 1
    assert err.splitlines() == [
        "gateway replay: failed: --fail-if per_ip.rejected >= 10%: 10.00% (1 of 10)",
        "gateway replay: failed: --fail-if per_ip.delayed == 0: 0",
    ]


def test_a_limit_the_policy_lacks_is_one_line_before_any_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = gate(tmp_path, capsys, "per_key.rejected > 1%")
    assert status == 1
    assert err == (
        f"gateway replay: --fail-if 'per_key.rejected > 1%': {tmp_path / 'policy.yaml'} has "
        "no limit 'per_key' (its limits: per_ip)\n"
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("rejected 1%", "expected FIGURE OPERATOR NUMBER[%]"),
        ("refused > 1%", "unknown figure 'refused'"),
        ("per_ip.allowed > 1", "a limit's figures are rejected, delayed"),
        ("rejected > 120%", "a share is at most 100%"),
    ],
)
def test_a_condition_that_cannot_be_read_is_refused(text: str, reason: str) -> None:
    with pytest.raises(GateError) as raised:
        parse_condition(text)
    assert reason in str(raised.value)


def test_a_bad_condition_is_a_usage_error_of_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", "-c", "x.yaml", "--fail-if", "x ~ 1", "-"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "--fail-if" in done.stderr and "expected FIGURE OPERATOR NUMBER[%]" in done.stderr
