"""A client's protocol error: one line at the configured level, rate-limited per cause; the
gateway's own faults pass through as ERROR with their traceback. The clock is a fake one;
the listeners' use of this logger is checked over real sockets in test_hostile_requests.py."""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, LineTooLong

from gateway.clock import FakeClock
from gateway.edge.client_errors import INTERVAL_S, MAX_CAUSES, ClientErrorLog, reason_of

BAD_TOKEN = BadHttpMessage("\n  Invalid header token:\n\n    b'Ho st: x'\n        ^")


def _refuse(errors: ClientErrorLog, exc: Exception, peer: str = "192.0.2.7") -> None:
    """What aiohttp's request handler does with a request its parser refused."""
    errors.exception("Error handling request from %s", peer, exc_info=exc)


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records]


def test_a_client_error_is_one_line_with_listener_peer_status_and_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    _refuse(ClientErrorLog("proxy", clock=FakeClock()), BAD_TOKEN)
    assert _lines(caplog) == [
        (
            "gateway.client",
            logging.INFO,
            "client protocol error on the proxy listener from 192.0.2.7: 400 Invalid header token",
        )
    ]
    assert caplog.records[0].exc_info is None


def test_one_line_per_cause_per_interval_with_the_count_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    errors = ClientErrorLog("admin", clock=clock)
    for _ in range(500):
        _refuse(errors, BAD_TOKEN)
        _refuse(errors, LineTooLong(bytearray(b"/" + b"a" * 9000), 8190))
        clock.advance(0.01)  # 5 s in all
    assert [message for _, _, message in _lines(caplog)] == [
        "client protocol error on the admin listener from 192.0.2.7: 400 Invalid header token",
        "client protocol error on the admin listener from 192.0.2.7: 400 Got more than 8190 "
        "bytes when reading",
    ]
    clock.advance(INTERVAL_S)
    _refuse(errors, BAD_TOKEN, peer="198.51.100.1")
    assert _lines(caplog)[-1][2] == (
        "client protocol error on the admin listener from 198.51.100.1: 400 Invalid header "
        "token (499 more like it since the last line)"
    )
    _refuse(errors, BAD_TOKEN)
    assert len(caplog.records) == 3


def test_the_level_is_configurable(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    errors = ClientErrorLog("proxy", logging.WARNING, clock=FakeClock())
    _refuse(errors, BadHttpMethod("\x16\x03\x01\x02"))
    errors.client_level = logging.DEBUG  # a reload
    _refuse(errors, BAD_TOKEN)
    assert [(level, message.split(": ", 1)[1]) for _, level, message in _lines(caplog)] == [
        (logging.WARNING, "400 Received HTTPS traffic on an HTTP port"),
        (logging.DEBUG, "400 Invalid header token"),
    ]


def test_the_gateways_own_faults_stay_errors_with_their_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    errors = ClientErrorLog("proxy", clock=FakeClock())
    try:
        raise KeyError("a bug of ours")
    except KeyError as exc:
        errors.exception("Error handling request from %s", "192.0.2.7", exc_info=exc)
    errors.exception("Unhandled exception", exc_info=RuntimeError("also ours"))
    assert [(name, level) for name, level, _ in _lines(caplog)] == [
        ("aiohttp.server", logging.ERROR),
        ("aiohttp.server", logging.ERROR),
    ]
    assert all(record.exc_info for record in caplog.records)


def test_the_reason_never_carries_the_clients_bytes() -> None:
    assert reason_of(BAD_TOKEN) == "Invalid header token"
    assert reason_of(BadHttpMethod("GET\x1b[2J")) == "Bad HTTP method in status line"
    assert reason_of(LineTooLong(bytearray(b"\x1b]0;x\x07"), 10)) == (
        "Got more than 10 bytes when reading"
    )
    # The parser's own apostrophe is not where a quotation starts.
    assert reason_of(BadHttpMessage("Transfer-Encoding can't be present with Content-Length")) == (
        "Transfer-Encoding can't be present with Content-Length"
    )
    assert reason_of(BadHttpMessage("Bad status line 'x'")) == "Bad status line"


def test_causes_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    errors = ClientErrorLog("proxy", clock=FakeClock())
    for index in range(MAX_CAUSES * 4):
        _refuse(errors, BadHttpMessage(f"cause {index}"))
    assert len(errors._causes) == MAX_CAUSES
    assert len(caplog.records) == MAX_CAUSES * 4
