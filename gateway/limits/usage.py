"""What a response's body says a request cost (``cost_from:``): the units an LLM API reports
as its usage, read from a JSON body or from the events of a Server-Sent Event stream as they
pass.

A ``UsageSource`` is compiled from the policy's ``cost_from`` (a preset, ``openai`` or
``anthropic``, or a sum of dotted paths such as ``usage.prompt_tokens +
usage.completion_tokens``). A ``UsageMeter`` is fed the body's chunks as the proxy relays them
(batched: the relay appends each to ``batch`` and flushes about every 16 KiB) and keeps at most
``MAX_USAGE_BYTES`` of them: the whole body while it is that small (JSON), or the unfinished
event's bytes (a stream); the stream itself is never buffered. Of a stream's whole events only
those holding a source's marker (bytes only its usage has) are split into lines and parsed.
``readings`` says the cost the body reported, or why there is none; ``model`` the model the
body named (in the documents read for the usage), which the unit metrics are labelled with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

from gateway.policy.cost_from import ANTHROPIC, MAX_DIGITS, json_at, parse_cost_from

# A stream's chunks are handed to the meter in batches of about this many bytes (the relay
# appends each to ``UsageMeter.batch``, a list, and calls ``flush`` past it): one call per
# batch, not per event.
BATCH_BYTES: Final = 16384
# Filed among what a response reported when its body was cut short: its cost is then at
# least what the request holds (its reservation), or the usage reported so far if more.
CUT: Final = b"body:cut"
# The most of a body (JSON) or of one event (a stream) kept to read the usage from: usage sits
# in small objects, and a body or an event past this is not read (the fallback is charged).
MAX_USAGE_BYTES: Final = 1 << 20
# Filed among what a response reported: the model its body named (``UsageMeter.model``), for
# the unit metrics' ``model`` label and the access log (a header name has no colon, and a
# ``cost_from`` source's key starts with ``body:``: no reading is filed under it).
MODEL: Final = b"response:model"
# The longest model name kept: a longer one (or one that is not printable ASCII) is none.
MAX_MODEL_CHARS: Final = 128


# A count of more than ``MAX_DIGITS`` digits is none (compared, not printed: per response).
_COUNT_BOUND: Final = 10**MAX_DIGITS
# JSON whitespace, the only bytes allowed around a document.
_JSON_SPACE: Final = " \t\n\r"
_DECODER: Final = json.JSONDecoder()


def _count(value: object) -> int | None:
    """A reported count: a JSON integer, 0 or more (a bool is none)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if value < 0 or value >= _COUNT_BOUND:
        return None
    return value


def _model_of(document: object) -> str | None:
    """The model a parsed body or event names: ``model`` (OpenAI's bodies and chunks,
    Anthropic's Messages body), or ``message.model`` (Anthropic's ``message_start``); a
    string of 1 to ``MAX_MODEL_CHARS`` printable ASCII characters, else None."""
    if not isinstance(document, dict):
        return None
    model = document.get("model")
    if model is None:
        message = document.get("message")
        if isinstance(message, dict):
            model = message.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS:
        return None
    if not model.isascii() or not model.isprintable():
        return None
    return model


def _last_blank_line(data: bytes) -> int:
    """Where the last ``\\n\\n`` or ``\\n\\r\\n`` begins (-1: none): the second searched only
    past the first (a stream's lines end alike: one pass over a chunk, not two)."""
    lf = data.rfind(b"\n\n")
    return max(lf, data.rfind(b"\n\r\n", max(lf, 0)))


def parse_json(data: bytes) -> object:
    """A JSON document in UTF-8 (what LLM APIs send; a byte order mark passed over), as
    ``json.loads`` reads it, without its detection of UTF-16 and 32 and its wrappers (a few
    microseconds a response): a ``ValueError`` when it is not one."""
    text = data.decode("utf-8-sig").strip(_JSON_SPACE)  # UnicodeDecodeError: a ValueError
    document, end = _DECODER.raw_decode(text)
    if end != len(text):
        raise ValueError("extra data after the JSON document")
    return document


class UsageSource:
    """One ``cost_from``: the key its reading is filed under (beside the cost headers', in
    what a limit is charged from and in the access log's ``costs``) and how to read it."""

    __slots__ = ("anthropic", "key", "marker", "paths", "text")

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        self.paths = parse_cost_from(self.text)
        self.key: bytes = b"body:" + self.text.encode()
        self.anthropic = self.text == ANTHROPIC
        # Bytes an event holds when this source can find something in it, searched for as
        # plain bytes over a whole chunk: the last field of the first path, which only the
        # usage itself names (an OpenAI stream's chunks say "usage": null until the last,
        # so "usage" would be in every one); Anthropic's message_start and message_delta
        # events (and message_stop: one small event more to parse).
        self.marker: bytes
        if self.anthropic:
            self.marker = b'"message_'
        else:
            self.marker = b'"' + self.paths[0][-1].encode() + b'"'

    def read(self, document: object) -> int | None:
        """The sum the paths name in a parsed document; None when one is missing or not a
        count."""
        total = 0
        for path in self.paths:
            found = _count(json_at(document, path))
            if found is None:
                return None
            total += found
        return total

    def why_not(self, document: object) -> str:
        """Why ``read`` found nothing in ``document``: the first path missing, or holding
        something that is not a count."""
        for path in self.paths:
            value = json_at(document, path)
            if value is None:
                return f"no {'.'.join(path)}"
            if _count(value) is None:
                return f"{'.'.join(path)} not a count"
        return "no usage"


class UsageMeter:
    """The usage one response's body reports, read as the body passes.

    JSON (any content type but an event stream): the body is kept while it is at most
    ``MAX_USAGE_BYTES`` and parsed at its end. A Server-Sent Event stream: each event's
    ``data`` lines are kept until the event ends (a blank line), parsed, and the newest
    reading each source finds in an event is kept (Anthropic's preset adds the input its
    ``message_start`` says to the output the newest ``message_delta`` says). So the reading is
    the usage the stream reported so far, whenever it stops.
    """

    __slots__ = (
        "_body",
        "_complete",
        "_event",
        "_input",
        "_kept",
        "_marker",
        "_markers",
        "_output",
        "_pending",
        "_problem",
        "_readings",
        "_too_large",
        "batch",
        "model",
        "sources",
        "stream",
    )

    def __init__(self, sources: Sequence[UsageSource], stream: bool) -> None:
        self.sources = tuple(sources)
        self.stream = stream
        self._body: list[bytes] = []
        # Chunks the relay has appended and the meter has not read yet (``flush``).
        self.batch: list[bytes] = []
        self._complete = False
        self._kept = 0
        # What an event must hold for some source to find its usage in it: one search.
        self._markers: tuple[bytes, ...] = tuple({source.marker: None for source in self.sources})
        # The one marker of a meter with one source (the common case): one search.
        self._marker: bytes | None = self._markers[0] if len(self._markers) == 1 else None
        self._too_large = False
        # The model the body named, as far as it was read (None: none yet).
        self.model: str | None = None
        # A stream: the bytes of the line being received, and the data of the current event.
        self._pending = b""
        self._event: list[bytes] = []
        self._readings: list[int | None] = [None] * len(self.sources)
        self._input: list[int | None] = [None] * len(self.sources)
        self._output: list[int | None] = [None] * len(self.sources)
        # Why the body gave a source nothing, when it did not (the log says it).
        self._problem: list[str] = [
            "a stream without usage (OpenAI's: ask for stream_options.include_usage)"
            if stream
            else "no body"
        ] * len(self.sources)

    def flush(self) -> None:
        """Read the chunks the relay batched."""
        batch = self.batch
        if batch:
            data = batch[0] if len(batch) == 1 else b"".join(batch)
            batch.clear()
            self.feed(data)

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the body, as they are relayed."""
        if not self.stream:
            if self._too_large:
                return
            self._kept += len(chunk)
            if self._kept > MAX_USAGE_BYTES:
                self._too_large = True
                self._body = []
                return
            self._body.append(chunk)
            return
        if not self._pending and chunk.endswith(b"\n\n") and not self._too_large:
            # The common case: a chunk of whole events (an upstream writes one at a time).
            if self._may_hold_usage(chunk):
                self._read_lines(chunk)
            return
        data = self._pending + chunk if self._pending else chunk
        # Only whole events are read: what follows the last blank line is kept, raw, for
        # the next chunk (at most the bound: the rest of a larger event is passed over).
        end = _last_blank_line(data)
        if end < 0:
            self._keep(data)
            return
        end = data.index(b"\n", end + 1) + 1
        whole, rest = data[:end], data[end:]
        if self._too_large:  # the end of an event past the bound: not read
            self._too_large = False
            first = min(i for i in (whole.find(b"\n\n"), whole.find(b"\n\r\n")) if i >= 0)
            whole = whole[whole.index(b"\n", first + 1) + 1 :]
        self._keep(rest)
        if whole and self._may_hold_usage(whole):
            self._read_lines(whole)

    def _read_lines(self, whole: bytes) -> None:
        """The events among ``whole`` (whole events) that may hold the usage, each read on
        its own: the others (most: text) are passed over unread, however many."""
        done = 0  # where the events read so far end
        while True:
            at, past = self._next_marker(whole, done)
            if at < 0:
                return
            before = max(
                whole.rfind(b"\n\n", done, at),
                whole.rfind(b"\n\r\n", done, at),
            )
            start = done if before < 0 else whole.index(b"\n", before + 1) + 1
            after = [i for i in (whole.find(b"\n\n", past), whole.find(b"\n\r\n", past)) if i >= 0]
            end = len(whole) if not after else whole.index(b"\n", min(after) + 1) + 1
            line_start = start
            while line_start < end:
                line_end = whole.find(b"\n", line_start, end)
                if line_end < 0:
                    break
                self._line(whole[line_start:line_end])
                line_start = line_end + 1
            done = end

    def _keep(self, rest: bytes) -> None:
        """Keep the unfinished event's bytes for the next chunk, up to the bound."""
        if len(rest) > MAX_USAGE_BYTES:
            self._too_large = True
            rest = b""
        self._pending = rest

    def _may_hold_usage(self, data: bytes) -> bool:
        marker = self._marker
        if marker is not None:
            return marker in data
        return any(marker in data for marker in self._markers)

    def _next_marker(self, data: bytes, start: int) -> tuple[int, int]:
        """Where the first marker at or after ``start`` begins and ends; (-1, -1) if none."""
        best, best_end = -1, -1
        for marker in self._markers:
            at = data.find(marker, start)
            if at >= 0 and (best < 0 or at < best):
                best, best_end = at, at + len(marker)
        return best, best_end

    def _line(self, line: bytes) -> None:
        """One line of a whole event (within the bound: ``feed`` kept it so)."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            self._dispatch()
            return
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            self._event.append(value)

    def _dispatch(self) -> None:
        """The end of an event: read it."""
        event, self._event = self._event, []
        if not event:
            return
        data = b"\n".join(event)
        if not data.startswith(b"{"):
            return  # ``[DONE]`` and the like
        if not self._may_hold_usage(data):
            return  # an event of text: no usage in it
        try:
            document = parse_json(data)
        except ValueError:
            return
        model = _model_of(document)
        if model is not None:
            self.model = model
        for index, source in enumerate(self.sources):
            if source.anthropic:
                self._anthropic_event(index, document)
                continue
            found = source.read(document)
            if found is not None:
                self._readings[index] = found

    def _anthropic_event(self, index: int, document: object) -> None:
        if not isinstance(document, dict):
            return
        kind = document.get("type")
        if kind == "message_start":
            usage = json_at(document, ("message", "usage"))
            found = _count(json_at(usage, ("input_tokens",)))
            if found is not None:
                self._input[index] = found
            output = _count(json_at(usage, ("output_tokens",)))
            if output is not None and self._output[index] is None:
                self._output[index] = output
        elif kind == "message_delta":
            found = _count(json_at(document, ("usage", "output_tokens")))
            if found is not None:
                self._output[index] = found
            # Newer streams repeat the input in each delta.
            found = _count(json_at(document, ("usage", "input_tokens")))
            if found is not None:
                self._input[index] = found
        else:
            return
        tokens_in, tokens_out = self._input[index], self._output[index]
        if tokens_in is not None and tokens_out is not None:
            self._readings[index] = tokens_in + tokens_out

    def finish(self) -> None:
        """The body has ended (a stream's last event may lack its blank line)."""
        self.flush()
        self._complete = True
        if self.stream:
            rest, self._pending = self._pending, b""
            if rest and not self._too_large and self._may_hold_usage(rest):
                for line in rest.split(b"\n"):
                    self._line(line)
                self._dispatch()
            return
        if self._too_large or not self._body:
            if self._too_large:
                self._problem = ["a body over 1 MiB" for _ in self.sources]
            return
        body = b"".join(self._body)
        self._body = []
        try:
            document = parse_json(body)
        except ValueError:
            self._problem = ["a body that is not JSON" for _ in self.sources]
            return
        self.model = _model_of(document)
        for index, source in enumerate(self.sources):
            found = self._readings[index] = source.read(document)
            if found is None:
                self._problem[index] = source.why_not(document)

    @property
    def complete(self) -> bool:
        """Whether the body was read to its end (not cut short: the client gone, the
        upstream failed)."""
        return self._complete

    def readings(self) -> list[tuple[UsageSource, int | None, str]]:
        """Each source, what the body said (None: nothing usable) and, then, why."""
        self.flush()  # a body cut short: what was batched is part of the usage so far
        return list(zip(self.sources, self._readings, self._problem, strict=True))


def is_event_stream(content_type: str | None) -> bool:
    """Whether a response's ``Content-Type`` is a Server-Sent Event stream."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
