"""Reading what a response's body says it cost (``limits/usage.py``): JSON bodies, Server-Sent
Event streams cut anywhere, the presets, and the bound on what a meter keeps."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.limits.usage import (
    MAX_MODEL_CHARS,
    MAX_USAGE_BYTES,
    UsageMeter,
    UsageSource,
    is_event_stream,
    parse_json,
)
from gateway.policy.cost_from import BadCostFrom, parse_cost_from


def _read(text: str, body: bytes, stream: bool, chunks: list[int] | None = None) -> int | None:
    meter = UsageMeter([UsageSource(text)], stream)
    start = 0
    for size in chunks or [len(body)]:
        meter.feed(body[start : start + size])
        start += size
    meter.feed(body[start:])
    meter.finish()
    ((_, reading, _),) = meter.readings()
    return reading


OPENAI_BODY = json.dumps(
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
).encode()


@pytest.mark.parametrize(
    ("text", "body", "want"),
    [
        ("openai", OPENAI_BODY, 12),
        ("usage.prompt_tokens + usage.completion_tokens", OPENAI_BODY, 12),
        ("usage.completion_tokens", OPENAI_BODY, 5),
        ("anthropic", b'{"usage": {"input_tokens": 3, "output_tokens": 4}}', 7),
        ("openai", b'{"usage": null}', None),
        ("openai", b'{"usage": {"total_tokens": "12"}}', None),
        ("openai", b'{"usage": {"total_tokens": -1}}', None),
        ("openai", b'{"usage": {"total_tokens": true}}', None),
        ("openai", b"not json", None),
        ("openai", b'{"usage": {"total_tokens": 999999999999999999}}', 999999999999999999),
        ("openai", b'{"usage": {"total_tokens": 1000000000000000000}}', None),
        ("openai", b"\xef\xbb\xbf \r\n" + OPENAI_BODY + b"\n\t", 12),
        ("openai", OPENAI_BODY + b" {}", None),
        ("openai", b"\x0b" + OPENAI_BODY, None),
        ("openai", b'{"x": "\xff", "usage": {"total_tokens": 1}}', None),
        ("data.0.n", b'{"data": [{"n": 9}]}', 9),
    ],
)
def test_a_json_body(text: str, body: bytes, want: int | None) -> None:
    assert _read(text, body, stream=False) == want


@given(
    st.binary(max_size=40)
    | st.text(alphabet='{}[]":,.-+eE0123456789 \t\n\x0b\ufeffa').map(str.encode)
)
@settings(max_examples=500, deadline=None)
def test_a_body_is_json_exactly_when_json_loads_reads_it(data: bytes) -> None:
    """The meter's own decoding (for speed) agrees with ``json.loads`` on UTF-8 bodies."""
    try:
        want: object = ("ok", json.loads(data))
    except ValueError:
        want = ("error",)
    if want == ("error",) or (data[:2] not in (b"\xff\xfe", b"\xfe\xff") and b"\x00" not in data):
        try:
            got: object = ("ok", parse_json(data))
        except ValueError:
            got = ("error",)
        assert repr(got) == repr(want)


def test_a_json_body_over_the_bound_is_not_read() -> None:
    body = b'{"pad": "' + b"x" * MAX_USAGE_BYTES + b'", "usage": {"total_tokens": 3}}'
    assert _read("openai", body, stream=False, chunks=[4096] * 10) is None


def _events(*documents: object, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    return b"".join(
        b"data: " + (d if isinstance(d, bytes) else json.dumps(d).encode()) + end + end
        for d in documents
    )


OPENAI_STREAM = _events(
    {"choices": [{"delta": {"content": "a"}}], "usage": None},
    {"choices": [{"delta": {"content": "b"}}], "usage": None},
    {"choices": [], "usage": {"total_tokens": 21}},
    b"[DONE]",
)
ANTHROPIC_STREAM = (
    b"event: message_start\n"
    + _events(
        {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}
    )
    + _events({"type": "content_block_delta", "delta": {"text": "hi"}})
    + b"event: message_delta\n"
    + _events({"type": "message_delta", "usage": {"output_tokens": 30}})
)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 50), max_size=30), crlf=st.booleans())
def test_a_stream_cut_into_any_chunks_reads_the_same(cuts: list[int], crlf: bool) -> None:
    body = OPENAI_STREAM.replace(b"\n", b"\r\n") if crlf else OPENAI_STREAM
    assert _read("openai", body, stream=True, chunks=cuts) == 21
    assert _read("anthropic", ANTHROPIC_STREAM, stream=True, chunks=cuts) == 39


def test_a_stream_reports_the_usage_so_far_and_says_whether_it_ended() -> None:
    meter = UsageMeter([UsageSource("anthropic")], stream=True)
    meter.feed(ANTHROPIC_STREAM[:150])
    ((_, reading, _),) = meter.readings()
    assert reading == 10 and not meter.complete  # the input, and 1 out so far
    meter.feed(ANTHROPIC_STREAM[150:])
    meter.finish()
    assert meter.readings()[0][1] == 39 and meter.complete


def test_a_long_stream_keeps_at_most_one_event() -> None:
    """300 MB of events pass through: what the meter holds stays within one event (and
    within its bound for an event larger than that)."""
    meter = UsageMeter([UsageSource("openai")], stream=True)
    event = _events({"choices": [{"delta": {"content": "x" * 1000}}], "usage": None})
    chunk = event * 64
    for _ in range(300_000_000 // len(chunk)):
        meter.feed(chunk)
        assert len(meter._pending) + sum(map(len, meter._event)) <= len(event)
    huge = b"data: " + b"y" * (MAX_USAGE_BYTES + 10)
    for start in range(0, len(huge), 65536):
        meter.feed(huge[start : start + 65536])
        assert len(meter._pending) + sum(map(len, meter._event)) <= MAX_USAGE_BYTES + 65536
    meter.feed(b"\n\n" + _events({"choices": [], "usage": {"total_tokens": 5}}))
    meter.finish()
    assert meter.readings()[0][1] == 5


def _model(text: str, body: bytes, stream: bool) -> str | None:
    meter = UsageMeter([UsageSource(text)], stream)
    meter.feed(body)
    meter.finish()
    return meter.model


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ("gpt-4o-2024-08-06", "gpt-4o-2024-08-06"),
        ("m" * MAX_MODEL_CHARS, "m" * MAX_MODEL_CHARS),
        ("m" * (MAX_MODEL_CHARS + 1), None),
        ("", None),
        ("gpt\n4o", None),
        ("modèle", None),
        (42, None),
        (None, None),
    ],
)
def test_the_model_a_body_names(model: object, named: str | None) -> None:
    """The model the metrics are labelled with: a JSON body's ``model``, an OpenAI stream's
    usage chunk's, an Anthropic stream's ``message_start``'s ``message.model``; a name of
    printable ASCII up to the bound, or none."""
    body = json.dumps({"model": model, "usage": {"total_tokens": 3}}).encode()
    assert _model("openai", body, stream=False) == named
    stream = _events(
        {"model": model, "choices": [{"delta": {"content": "a"}}], "usage": None},
        {"model": model, "choices": [], "usage": {"total_tokens": 3}},
        b"[DONE]",
    )
    assert _model("openai", stream, stream=True) == named
    start = {"type": "message_start", "message": {"model": model, "usage": {"input_tokens": 1}}}
    assert _model("anthropic", _events(start), stream=True) == named


def test_bad_cost_from_and_content_types() -> None:
    with pytest.raises(BadCostFrom, match="is not a path"):
        parse_cost_from("usage.total_tokens * 2")
    assert parse_cost_from("openai") == (("usage", "total_tokens"),)
    assert is_event_stream("text/event-stream; charset=utf-8")
    assert not is_event_stream("application/json")
    assert not is_event_stream(None)
