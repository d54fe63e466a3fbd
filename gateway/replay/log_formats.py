"""Access logs read as requests: nginx ``combined``, the gateway's own JSON log, JSON lines.

``READERS`` is the one table of formats: for each, how its first line is recognised and how a
log of it is read; a new format is one entry there. Every reader yields ``Request`` records
with an integer microsecond instant. Logs are written when a request ends, not when it was
decided, so records go through a bounded reorder heap (``in_time_order``) before the
simulation sees them. A line that cannot be read is counted with its file, line number and
reason (``Malformed``), never fatal.
"""

from __future__ import annotations

import calendar
import codecs
import gzip
import heapq
import io
import json
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any, Final, Literal, NamedTuple, cast

Format = Literal["combined", "gateway", "jsonl"]

US: Final = 1_000_000
# Malformed lines kept with their reason (all are counted).
MALFORMED_KEPT = 50


class Request:
    """One logged request, as the simulation needs it. Treated as immutable (compared by
    value); the reader sets a second's spread instants before handing it on.

    A plain class, not a NamedTuple: compiled, one is built per line in place, where a
    NamedTuple is built through its interpreted ``__new__`` (or as a tuple, then copied)."""

    __slots__ = (
        "address",
        "costs",
        "duration_us",
        "forwarded_for",
        "headers",
        "host",
        "line",
        "method",
        "source",
        "status",
        "t_us",
        "target",
    )

    def __init__(
        self,
        t_us: int,
        source: str,
        line: int,
        address: str,
        method: str,
        target: str,
        host: str | None,
        headers: tuple[tuple[str, str], ...],
        forwarded_for: str | None,
        status: int | None = None,
        costs: tuple[tuple[str, str], ...] = (),
        duration_us: int = -1,
    ) -> None:
        self.t_us = t_us
        self.source = source  # file name, for messages
        self.line = line
        self.address = address  # the log's client address field
        self.method = method
        self.target = target  # as sent: path and query
        self.host = host
        self.headers = headers
        self.forwarded_for = forwarded_for  # an X-Forwarded-For value, when the log has one
        self.status = status  # the response's status, when the log has one
        # Cost headers the upstream reported (the gateway's log records them), by lower-case
        # name.
        self.costs = costs
        # How long the request took ($request_time, the gateway's duration_ms), in
        # microseconds; -1 when the log does not say. A concurrency limit's slots are held
        # that long.
        self.duration_us = duration_us

    def _fields(self) -> tuple[object, ...]:
        return (
            self.t_us,
            self.source,
            self.line,
            self.address,
            self.method,
            self.target,
            self.host,
            self.headers,
            self.forwarded_for,
            self.status,
            self.costs,
            self.duration_us,
        )

    def at(self, t_us: int) -> Request:
        """The same request at another instant."""
        return Request(
            t_us,
            self.source,
            self.line,
            self.address,
            self.method,
            self.target,
            self.host,
            self.headers,
            self.forwarded_for,
            self.status,
            self.costs,
            self.duration_us,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"Request{self._fields()!r}"


class Malformed(NamedTuple):
    source: str
    line: int
    reason: str


@dataclass
class ReadStats:
    """What reading the logs found besides requests; shown in every report."""

    lines: int = 0
    requests: int = 0
    malformed: int = 0
    malformed_kept: list[Malformed] = field(default_factory=list)
    late: int = 0  # arrived later than the reorder window allows: decided at the latest instant
    spread_seconds: bool = False  # second-resolution timestamps spread over their second
    formats: dict[str, str] = field(default_factory=dict)  # source -> format read
    notes: list[str] = field(default_factory=list)
    has_forwarded_for: bool = False
    has_headers: bool = False
    has_host: bool = False
    has_status: bool = False
    has_costs: bool = False
    # Calendar time minus the log's instants, when they are on another clock (the gateway's
    # ``t_us`` is monotonic; its ``ts`` is calendar time): what calendar windows are read by.
    unix_offset_us: int | None = None
    durations: int = 0  # requests whose log line gave their duration
    own_records: int = 0  # the gateway's own log lines beside its access lines: skipped

    def bad(self, source: str, line: int, reason: str) -> None:
        self.malformed += 1
        if len(self.malformed_kept) < MALFORMED_KEPT:
            self.malformed_kept.append(Malformed(source, line, reason))


class LogError(Exception):
    """A log that cannot be read at all (missing, unknown format): one line for the user."""


# -- opening -----------------------------------------------------------------------------------


class Opened(NamedTuple):
    name: str
    text: IO[str]
    raw: IO[bytes]  # the file as stored (compressed when gzipped): progress is read from it
    size: int | None


def open_log(path: str) -> Opened:
    """A log as text: ``-`` is standard input; gzip is recognised by its magic bytes."""
    if path == "-":
        raw = sys.stdin.buffer
        name = "<stdin>"
        size = None
    else:
        try:
            raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
        except OSError as exc:
            raise LogError(f"{path}: cannot open: {exc.strerror or exc}") from None
        name = path
        try:
            import os

            size = os.fstat(raw.fileno()).st_size
        except OSError:
            size = None
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(cast(Any, raw))
    magic = buffered.peek(2)[:2]
    stream: IO[bytes] = buffered
    if magic == b"\x1f\x8b":
        stream = gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[assignment]
    # Bytes that are not UTF-8 (nginx escapes them, other writers may not) become U+FFFD: a
    # replay's keys and paths are then always printable in every report.
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n")
    return Opened(name, text, buffered, size)


def close_log(opened: Opened) -> None:
    """Close a log (a gzip reader leaves the file under it open); standard input stays open."""
    if opened.name == "<stdin>":
        return
    opened.text.close()
    opened.raw.close()


def numbered_lines(opened: Opened, stats: ReadStats) -> Iterator[tuple[int, str]]:
    """The lines of a log, numbered from 1; a truncated gzip stream ends the file with a note."""
    number = 0
    try:
        for number, line in enumerate(opened.text, 1):
            yield number, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        stats.notes.append(f"{opened.name}: compressed data ends early after line {number}: {exc}")
    except OSError as failed:  # one name per type: compiled, a shared one is typed as the first
        stats.notes.append(f"{opened.name}: read error after line {number}: {failed}")


# -- nginx combined ----------------------------------------------------------------------------

# $remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent
# "$http_referer" "$http_user_agent", then optional extra fields ("$http_x_forwarded_for",
# $msec, $request_time). nginx escapes '"' in logged strings as \x22.
# Each repeat is possessive (``++``, ``*+``), the same matches found faster: what follows it
# starts with a character it cannot take (or is ``(.*)``, which takes the rest of the line),
# so giving characters back could never lead to a match, and the matcher keeps no place for it.
_COMBINED = re.compile(
    r'(\S++) \S++ (?:"[^"]*+"|\S++) \[([^\]]++)\] "([^"]*+)" (\d{3}|-) \S++'
    r'(?: "[^"]*+" "[^"]*+")?(.*)'
)
_EXTRA = re.compile(r'"([^"]*)"|(\S+)')
_MONTHS = {
    name: index
    for index, name in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
    )
}
# $msec is seconds since the epoch; $request_time a duration. Anything above this is an epoch.
_EPOCH_FLOOR = 100_000_000.0


def parse_time_local(text: str) -> int:
    """nginx ``$time_local`` (``10/Oct/2000:13:55:36 -0700``) as epoch seconds."""
    if len(text) != 26 or text[2] != "/" or text[6] != "/" or text[20] != " ":
        raise ValueError(f"bad time {text!r}")
    month = _MONTHS.get(text[3:6])
    if month is None:
        raise ValueError(f"bad month in {text!r}")
    seconds = calendar.timegm(
        (
            int(text[7:11]),
            month,
            int(text[0:2]),
            int(text[12:14]),
            int(text[15:17]),
            int(text[18:20]),
            0,
            0,
            0,
        )
    )
    sign = -1 if text[21] == "-" else 1
    offset = sign * (int(text[22:24]) * 3600 + int(text[24:26]) * 60)
    return seconds - offset


# Distinct request lines kept split by ``read_combined`` before it starts afresh; likewise
# status texts read as numbers.
_REQUEST_LINES_KEPT = 1 << 16
_STATUSES_KEPT = 1 << 10


def _split_request_line(request_line: str) -> tuple[str, str] | None:
    parts = request_line.split(" ")
    if len(parts) == 3 and parts[2].startswith("HTTP/"):
        method, target = parts[0], parts[1]
    elif len(parts) == 2:  # HTTP/0.9
        method, target = parts
    else:
        return None
    if not method.isalpha() or not method.isupper() or not target:
        return None
    return method, target


def read_combined(opened: Opened, stats: ReadStats) -> Iterator[Request]:
    """nginx ``combined``: ``$time_local`` has whole seconds, so the requests logged in one
    second are spread evenly across it (unless a ``$msec`` field gives the instant); a
    ``$request_time`` field moves each back to when it arrived.

    The hot loop of a replay: a request line, like a time, is split once while it repeats (a
    log has few distinct ones), and each record is built once (a second's are given their
    instants when the second ends)."""
    name = opened.name
    extras = _EXTRA.findall
    split_lines: dict[str, tuple[str, str] | None] = {}
    last_text = ""
    last_second = 0
    group_second = 0
    group: list[Request] = []  # one second's requests, not yet spread
    # Each status text's number: ``int()`` of one costs more than a lookup.
    statuses: dict[str, int] = {}
    last_status_text = ""  # the last status read (not '-'), and its number
    last_status = 0
    number = 0
    try:
        for first, rows in _combined_pieces(opened):
            number = first - 1
            for row in rows:  # not ``enumerate``: compiled, it builds a tuple per line
                number += 1
                if isinstance(row, str):
                    if row.strip():
                        stats.bad(name, number, "not an nginx combined log line")
                    continue
                address, time_text, request_line, status_text, rest = row
                status: int | None = None
                if status_text == last_status_text:
                    status = last_status  # most lines have the status of the line before
                elif status_text != "-":
                    status = statuses.get(status_text)
                    if status is None:
                        if len(statuses) >= _STATUSES_KEPT:
                            statuses.clear()
                        status = statuses[status_text] = int(status_text)
                    last_status_text = status_text
                    last_status = status
                    stats.has_status = True
                try:
                    request = split_lines[request_line]
                except KeyError:
                    if len(split_lines) >= _REQUEST_LINES_KEPT:
                        split_lines.clear()
                    request = split_lines[request_line] = _split_request_line(request_line)
                if request is None:
                    stats.bad(
                        name, number, f"request line {request_line[:60]!r} is not METHOD TARGET"
                    )
                    continue
                if time_text != last_text:
                    try:
                        last_second = parse_time_local(time_text)
                    except ValueError as unparsed:
                        stats.bad(name, number, str(unparsed))
                        continue
                    last_text = time_text
                method, target = request
                if not rest:
                    if group_second != last_second:
                        if group:
                            _spread(group, group_second, stats)
                            for spread in group:
                                yield spread
                            group.clear()
                        group_second = last_second
                    group.append(
                        Request(0, name, number, address, method, target, None, (), None, status)
                    )
                    continue
                forwarded_for: str | None = None
                msec_us: int | None = None
                request_time_us = 0
                seen_number = False
                for quoted, bare in extras(rest):
                    if bare:
                        try:
                            value = float(bare)
                        except ValueError:
                            continue
                        if value >= _EPOCH_FLOOR:
                            msec_us = round(value * US)
                        elif not seen_number and value >= 0.0:
                            request_time_us = round(value * US)
                            seen_number = True
                    elif forwarded_for is None and quoted not in ("", "-"):
                        forwarded_for = quoted
                if forwarded_for is not None:
                    stats.has_forwarded_for = True
                duration_us = -1
                if seen_number:
                    duration_us = request_time_us
                    stats.durations += 1
                if msec_us is not None:
                    if group:
                        _spread(group, group_second, stats)
                        for spread in group:
                            yield spread
                        group.clear()
                    yield Request(
                        msec_us - request_time_us,
                        name,
                        number,
                        address,
                        method,
                        target,
                        None,
                        (),
                        forwarded_for,
                        status,
                        (),
                        duration_us,
                    )
                    continue
                if group_second != last_second:
                    if group:
                        _spread(group, group_second, stats)
                        for spread in group:
                            yield spread
                        group.clear()
                    group_second = last_second
                group.append(
                    Request(
                        0,
                        name,
                        number,
                        address,
                        method,
                        target,
                        None,
                        (),
                        forwarded_for,
                        status,
                        (),
                        duration_us,
                    )
                )
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        stats.notes.append(f"{opened.name}: compressed data ends early after line {number}: {exc}")
    except OSError as failed:  # one name per type: compiled, a shared one is typed as the first
        stats.notes.append(f"{opened.name}: read error after line {number}: {failed}")
    finally:
        stats.lines += number
    if group:
        _spread(group, group_second, stats)
        for spread in group:
            yield spread


# The log read in pieces of about this many bytes, each matched as a whole.
_PIECE_BYTES = 1 << 16
_COMBINED_LINES = re.compile(f"^(?:{_COMBINED.pattern})$", re.MULTILINE)
_Row = tuple[str, str, str, str, str]


def _combined_pieces(opened: Opened) -> Iterator[tuple[int, list[_Row | str]]]:
    """The lines of a combined log in pieces, each with the number of its first line: per
    line the pattern's five groups, or the line itself (without its end) when they do not
    match.

    Where the log's bytes can be read as they come (``read1``), a piece of whole lines is
    read at once: in ASCII text with no whitespace but spaces and line ends (``_plain``), line
    by line by hand (``_fields``, the pattern for a line it does not take); otherwise matched
    as a whole (``findall``): when every line of it matched, each match is its line's (a
    match cannot span lines and leave the count whole), else the piece goes line by line.
    The pieces are decoded as ``open_log``'s text reader decodes, and a read that fails loses
    only the line it cut, as reading line by line does."""
    buffer = getattr(opened.text, "buffer", None)
    read1 = getattr(buffer, "read1", None)
    match = _COMBINED.fullmatch
    if read1 is None:
        for number, raw_line in enumerate(opened.text, 1):
            line = raw_line.rstrip("\r\n")
            found = match(line)
            yield number, [line if found is None else cast(_Row, found.groups())]
        return
    findall = _COMBINED_LINES.findall
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    carry = ""
    first = 1
    while True:
        data = read1(_PIECE_BYTES)
        text = carry + decode(data, final=not data)
        end = len(text) if not data else text.rfind("\n") + 1
        carry = text[end:]
        piece = text[:end]
        if piece:
            rows: list[_Row | str] | None = None
            if _plain(piece):
                rows = _plain_rows(piece)
                yield first, rows
                first += len(rows)
                continue
            lines = piece.count("\n") + (not piece.endswith("\n"))  # the last may have no end
            if "\r" not in piece:
                rows = findall(piece)
                if len(rows) != lines:
                    rows = None
            if rows is None:
                if piece.endswith("\n"):
                    piece = piece[:-1]
                rows = []
                for line in piece.split("\n"):
                    line = line.rstrip("\r")
                    found = match(line)
                    rows.append(line if found is None else cast(_Row, found.groups()))
            yield first, rows
            first += lines
        if not data:
            return


# ASCII whitespace but the space and the line end (``str.isspace``, which the pattern's
# ``\S`` excludes): in a piece without these, ``\S`` within a line is any character but a space.
_OTHER_SPACES: Final = ("\t", "\x0b", "\x0c", "\r", "\x1c", "\x1d", "\x1e", "\x1f")


def _plain(piece: str) -> bool:
    """Whether ``_fields`` may read the piece's lines: ASCII (the pattern's ``\\d`` is then
    0-9) with no whitespace but spaces and line ends."""
    return piece.isascii() and all(space not in piece for space in _OTHER_SPACES)


def _plain_rows(piece: str) -> list[_Row | str]:
    """Each line of a ``_plain`` piece as ``_combined_pieces`` gives it: its fields by hand, or
    by the pattern where ``_fields`` does not take the line."""
    rows: list[_Row | str] = []
    size = len(piece)
    start = 0
    while start < size:
        end = piece.find("\n", start)
        if end < 0:
            end = size  # the log's last line, without its end
        row = _fields(piece, start, end)
        if row is None:
            line = piece[start:end]
            found = _COMBINED.fullmatch(line)
            rows.append(line if found is None else cast(_Row, found.groups()))
        else:
            rows.append(row)
        start = end + 1
    return rows


def _fields(text: str, start: int, end: int) -> _Row | None:
    """The groups ``_COMBINED`` finds in the line ``text[start:end]`` of a ``_plain`` piece,
    found by hand, in its order (the user field quoted first, the referer and agent if both
    are there); None when this way does not find them (the pattern then decides the line).

    Where the pattern's first way through a line matches, this finds the same groups: each
    repeat of the pattern is possessive, so a field ends at the first character it cannot
    take (``find``; ``_space_from`` for the fields of a few characters), and ``\\S`` is any
    character but a space in such a piece. The only alternatives the pattern could go back
    to (the user field unquoted, a status of '-') are never needed when the first way gets
    to the line's end."""
    address_end = text.find(" ", start, end)
    if address_end <= start:
        return None
    ident_end = _space_from(text, address_end + 1, end)
    if ident_end <= address_end + 1:
        return None
    user = ident_end + 1
    if user >= end:
        return None
    if text[user] == '"':
        user_end = text.find('"', user + 1, end) + 1
        if user_end <= 0:
            return None
    else:
        user_end = _space_from(text, user, end)
        if user_end <= user:
            return None
    if user_end + 1 >= end or text[user_end] != " " or text[user_end + 1] != "[":
        return None
    time_start = user_end + 2
    time_end = text.find("]", time_start, end)
    if time_end <= time_start:
        return None
    if time_end + 2 >= end or text[time_end + 1] != " " or text[time_end + 2] != '"':
        return None
    line_start = time_end + 3
    line_end = text.find('"', line_start, end)
    status_start = line_end + 2
    if line_end < 0 or status_start >= end or text[line_end + 1] != " ":
        return None
    status_end = status_start + 1 if text[status_start] == "-" else status_start + 3
    if status_end >= end or text[status_end] != " ":
        return None
    status = text[status_start:status_end]
    if status != "-" and not status.isdigit():
        return None
    size_start = status_end + 1
    if size_start >= end or text[size_start] == " ":
        return None
    rest = _space_from(text, size_start, end)
    if rest < 0:
        rest = end
    elif rest + 1 < end and text[rest + 1] == '"':
        referer_end = _quote_from(text, rest + 2, end)
        if (
            referer_end >= 0
            and referer_end + 2 < end
            and text[referer_end + 1] == " "
            and text[referer_end + 2] == '"'
        ):
            agent_end = text.find('"', referer_end + 3, end)
            if agent_end >= 0:
                rest = agent_end + 1
    return (
        text[start:address_end],
        text[time_start:time_end],
        text[line_start:line_end],
        status,
        text[rest:end],
    )


def _space_from(text: str, at: int, end: int) -> int:
    """``text.find(" ", at, end)`` for a field of a few characters: compiled, a loop over
    them is cheaper than the call (about 150 instructions a field)."""
    while at < end:
        if text[at] == " ":
            return at
        at += 1
    return -1


def _quote_from(text: str, at: int, end: int) -> int:
    """``text.find('"', at, end)``, likewise."""
    while at < end:
        if text[at] == '"':
            return at
        at += 1
    return -1


def _spread(group: list[Request], second: int, stats: ReadStats) -> None:
    """Give the requests logged in one second their instants, spread evenly across it (each
    moved back by its duration, when the log gives one)."""
    stats.spread_seconds = True
    count = len(group)
    base = second * US
    for index, request in enumerate(group):
        duration_us = request.duration_us
        request.t_us = base + index * US // count - (duration_us if duration_us > 0 else 0)


# -- JSON logs ---------------------------------------------------------------------------------


def _json_object(line: str) -> dict[str, Any] | None:
    """The JSON object on a line; text before its '{' (a logging prefix) is skipped."""
    start = line.find("{")
    if start < 0:
        return None
    try:
        value = json.loads(line[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_ts(value: object) -> int:
    """``ts`` as epoch seconds (a number) or ISO 8601 text, in integer microseconds."""
    if isinstance(value, bool):
        raise ValueError("ts is not a time")
    if isinstance(value, int | float):
        return round(value * US)
    if isinstance(value, str):
        text = value.strip()
        try:
            return round(float(text) * US)
        except ValueError:
            pass
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            raise ValueError(f"ts {value!r} has no time zone")
        return calendar.timegm(moment.utctimetuple()) * US + moment.microsecond
    raise ValueError("ts is not a time")


def _text(obj: dict[str, Any], key: str, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ValueError(f"no {key!r}")
        return None
    if not isinstance(value, str) or (required and not value):
        raise ValueError(f"{key!r} is not text")
    return value


def _duration_us(obj: dict[str, Any]) -> int:
    """``duration_ms`` (the gateway's log) or ``request_time`` (seconds, as nginx logs it) in
    microseconds; -1 when neither is given."""
    for key, scale in (("duration_ms", 1000), ("request_time", US)):
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{key!r} is not a duration")
        return round(value * scale)
    return -1


def read_json(opened: Opened, stats: ReadStats, fmt: Format) -> Iterator[Request]:
    """The gateway's JSON access log (``t_us``: the limiter's instant; ``client``: the client
    it resolved; the gateway's own log lines beside it skipped) or JSON lines with ``ts``,
    ``ip``, ``method``, ``path`` and optional ``headers`` (and ``host``); either with
    ``duration_ms`` or ``request_time``."""
    name = opened.name
    gateway = fmt == "gateway"
    for number, line in numbered_lines(opened, stats):
        stats.lines += 1
        if not line.strip():
            continue
        if gateway and not line.startswith("{") and _is_own_record(line):
            stats.own_records += 1
            continue
        obj = _json_object(line)
        if obj is None:
            stats.bad(name, number, "not a JSON object")
            continue
        if gateway and "logger" in obj and "level" in obj and "t_us" not in obj:
            stats.own_records += 1  # one of the gateway's own lines, with --log-format json
            continue
        try:
            if gateway:
                t_us_value = obj.get("t_us")
                if isinstance(t_us_value, int) and not isinstance(t_us_value, bool):
                    t_us = t_us_value
                elif "ts" in obj:
                    t_us = parse_ts(obj["ts"])
                else:
                    raise ValueError("no 't_us' or 'ts'")
                address = _text(obj, "client")
                if stats.unix_offset_us is None and "ts" in obj and "t_us" in obj:
                    stats.unix_offset_us = parse_ts(obj["ts"]) - t_us
            else:
                t_us = parse_ts(obj.get("ts"))
                address = _text(obj, "ip")
            method = _text(obj, "method")
            target = _text(obj, "path")
            host = _text(obj, "host", required=False)
            headers: tuple[tuple[str, str], ...] = ()
            raw_headers = obj.get("headers")
            if raw_headers is not None:
                if not isinstance(raw_headers, dict) or not all(
                    isinstance(v, str) for v in raw_headers.values()
                ):
                    raise ValueError("'headers' is not an object of text values")
                headers = tuple(raw_headers.items())
                stats.has_headers = True
            duration_us = _duration_us(obj)
            status = _status(obj.get("status"))
            costs: tuple[tuple[str, str], ...] = ()
            raw_costs = obj.get("costs")
            if raw_costs is not None:
                if not isinstance(raw_costs, dict) or not all(
                    isinstance(v, str) for v in raw_costs.values()
                ):
                    raise ValueError("'costs' is not an object of text values")
                costs = tuple((name.lower(), value) for name, value in raw_costs.items())
                stats.has_costs = True
        except ValueError as exc:
            stats.bad(name, number, str(exc))
            continue
        assert address is not None and method is not None and target is not None
        forwarded_for = None
        for header, value in headers:
            if header.lower() == "x-forwarded-for":
                forwarded_for = value
                stats.has_forwarded_for = True
        if host is None:
            for header, value in headers:
                if header.lower() == "host":
                    host = value
        if host is not None:
            stats.has_host = True
        if status is not None:
            stats.has_status = True
        if duration_us >= 0:
            stats.durations += 1
        yield Request(
            t_us,
            name,
            number,
            address,
            method,
            target,
            host,
            headers,
            forwarded_for,
            status,
            costs,
            duration_us,
        )


def _status(value: object) -> int | None:
    """A logged response status (100 to 599, a number or its digits), or None when there is
    none or it is not one (the request is still replayed: the report says what that means)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
        return None
    return value


# -- the table of formats, detection and the whole set of logs ------------------------------

# The gateway's own log lines (``gateway/log_setup.py``), which share its stderr with the access
# log: in text, ``TIME LEVEL LOGGER[PID]: message``; in JSON, an object with ``level`` and
# ``logger``. They are not requests: a gateway log is read past them, not stopped by them.
_OWN_TEXT: Final = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ([\w.-]+)\[\d+\]: ")
ACCESS_LOGGER: Final = "gateway.access"


def _is_own_record(line: str) -> bool:
    """A line of the gateway's own log, not an access line (which may follow a text prefix)."""
    prefix = _OWN_TEXT.match(line)
    if prefix is not None:
        return prefix.group(1) != ACCESS_LOGGER
    obj = _json_object(line) if line.startswith("{") else None
    return obj is not None and "logger" in obj and "level" in obj and "t_us" not in obj


def _is_text_access_line(line: str) -> bool:
    """An access line in text (``access_log_format: text``), which a replay cannot read."""
    prefix = _OWN_TEXT.match(line)
    return prefix is not None and prefix.group(1) == ACCESS_LOGGER and "{" not in line


def _is_gateway_log(line: str) -> bool:
    obj = _json_object(line)
    return obj is not None and (
        "t_us" in obj or ("route" in obj and "limit" in obj and "client" in obj)
    )


def _is_json_line(line: str) -> bool:
    return _json_object(line) is not None


def _is_combined(line: str) -> bool:
    return _COMBINED.fullmatch(line.rstrip("\r\n")) is not None


def read_gateway_log(opened: Opened, stats: ReadStats) -> Iterator[Request]:
    return read_json(opened, stats, "gateway")


def read_json_lines(opened: Opened, stats: ReadStats) -> Iterator[Request]:
    return read_json(opened, stats, "jsonl")


class LogReader(NamedTuple):
    """One log format: whether a first line is of it, and how a log of it is read."""

    detect: Callable[[str], bool]
    read: Callable[[Opened, ReadStats], Iterator[Request]]


# Asked in this order when the format is ``auto``: the gateway's JSON log is also JSON lines.
READERS: Final[dict[Format, LogReader]] = {
    "gateway": LogReader(_is_gateway_log, read_gateway_log),
    "jsonl": LogReader(_is_json_line, read_json_lines),
    "combined": LogReader(_is_combined, read_combined),
}
FORMATS: Final[tuple[str, ...]] = ("auto", *sorted(READERS))


def detect(line: str) -> Format | None:
    """The first format in ``READERS`` that ``line`` is of."""
    for fmt, reader in READERS.items():
        if reader.detect(line):
            return fmt
    return None


def _first_line(text: IO[str]) -> tuple[int, str]:
    """Peek at the first non-blank line that is not one of the gateway's own log lines (else
    the first non-blank line), and its number, without consuming it."""
    buffer = text.buffer  # type: ignore[attr-defined]
    peeked = buffer.peek(65536) if hasattr(buffer, "peek") else b""
    first: tuple[int, str] = (0, "")
    for number, raw in enumerate(peeked.split(b"\n"), 1):
        if raw.strip():
            line = str(raw.decode("utf-8", "replace"))
            if not _is_own_record(line):
                return number, line
            if not first[1]:
                first = (number, line)
    return first


def read_log(opened: Opened, fmt: str, stats: ReadStats) -> Iterator[Request]:
    """The requests of one log, in ``fmt`` (one of ``FORMATS``; ``auto``: told from its
    first line)."""
    chosen: Format
    if fmt == "auto":
        number, first = _first_line(opened.text)
        if not first:
            stats.formats[opened.name] = "empty"
            return iter(())
        found = detect(first)
        if found is None and _is_text_access_line(first):
            raise LogError(
                f"{opened.name}: line {number}: the gateway's access log in text cannot be "
                "replayed: write it as JSON (server.access_log_format: json)"
            )
        if found is None:
            raise LogError(
                f"{opened.name}: line {number}: cannot tell the log format "
                f"(use --format {'|'.join(sorted(READERS))})"
            )
        chosen = found
    elif fmt in READERS:
        chosen = fmt
    else:
        raise LogError(f"unknown log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    stats.formats[opened.name] = chosen
    return READERS[chosen].read(opened, stats)


def in_time_order(
    records: Iterable[Request], window_us: int, stats: ReadStats
) -> Iterator[Request]:
    """Records by instant (ties in log order), reordered within ``window_us``: a log line is
    written when its request ends, up to its delay and the upstream's time after it began.
    A record older than the window allows is decided at the latest instant already replayed.

    While records come in order (most logs, most of the time) they wait in a FIFO, which is
    already in (instant, arrival) order; the first one out of order turns what waits into a
    heap, used until it drains. The order out is the heap's either way. The FIFO is a list
    read from ``head`` (compiled, a list's items are read by index, a deque's through a
    call), its read part dropped once it is most of the list."""
    queue: list[Request] = []
    head = 0
    heap: list[tuple[int, int, Request]] = []
    push = heapq.heappush
    pop = heapq.heappop
    newest = -(1 << 62)
    emitted = -(1 << 62)
    last_in = -(1 << 62)  # the instant of the queue's last record
    seq = 0
    late = 0
    try:
        for record in records:
            seq += 1
            t_us = record.t_us
            if t_us < emitted:
                late += 1
                t_us = emitted
                record = record.at(t_us)
            if heap:
                push(heap, (t_us, seq, record))
            elif t_us >= last_in:
                queue.append(record)
                last_in = t_us
            else:
                # The queue holds the last records, in order: a sorted list is a heap.
                first = seq - (len(queue) - head)
                heap = [(r.t_us, first + i, r) for i, r in enumerate(queue[head:])]
                queue.clear()
                head = 0
                push(heap, (t_us, seq, record))
            if t_us > newest:
                newest = t_us
                horizon = newest - window_us
                if heap:
                    while heap and heap[0][0] <= horizon:
                        item = pop(heap)
                        emitted = item[0]
                        yield item[2]
                    if not heap:
                        last_in = emitted
                else:
                    while head < len(queue) and queue[head].t_us <= horizon:
                        record = queue[head]
                        head += 1
                        emitted = record.t_us
                        yield record
                    if head > _QUEUE_READ_KEPT and head * 2 > len(queue):
                        del queue[:head]
                        head = 0
        while heap:
            yield pop(heap)[2]
        yield from queue[head:]
    finally:
        stats.requests += seq
        stats.late += late


# Records ``in_time_order`` has read off its FIFO before it drops them from the list.
_QUEUE_READ_KEPT: Final = 4096
