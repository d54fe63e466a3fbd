"""The gateway's log lines: one record, one line, in text as in JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gateway.engine.preflight import load_and_build
from gateway.log_setup import GatewayFormatter
from gateway.serving.reload import PolicyReloader
from tests.support.policies import policy_for


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("gateway.reload", logging.ERROR, __file__, 1, message, args, exc_info)


def _raised() -> ValueError:
    try:
        raise ValueError("bad\nthing")
    except ValueError as exc:
        return exc


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_record_of_several_lines_is_one_line(log_format: str) -> None:
    formatter = GatewayFormatter(log_format)  # type: ignore[arg-type]
    line = formatter.format(
        _record("reload failed:\n%s", "p.yaml:2: a\np.yaml:3: b", exc=_raised())
    )
    assert "\n" not in line
    if log_format == "json":
        record = json.loads(line)
        assert record["message"] == "reload failed:\np.yaml:2: a\np.yaml:3: b"
        assert "ValueError: bad" in record["exc_info"]
    else:
        assert " ERROR gateway.reload[" in line
        assert line.endswith("ValueError: bad | thing")
        assert "reload failed: | p.yaml:2: a | p.yaml:3: b | Traceback" in line


async def test_a_failed_reload_is_one_line_with_every_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for("http://127.0.0.1:9"))
    loaded = load_and_build(path)
    reloader = PolicyReloader(path, running=lambda: loaded, apply=lambda new: None)
    path.write_text("server:\n  workers: 0\n  listen: nowhere\n")
    assert await reloader.reload() == "failed"
    (record,) = [r for r in caplog.records if r.name == "gateway.reload"]
    message = record.getMessage()
    assert "\n" not in message
    assert message.startswith("policy reload failed, keeping the running policy: ")
    assert f"{path}:2: server.workers" in message and f"{path}:3: server.listen" in message
