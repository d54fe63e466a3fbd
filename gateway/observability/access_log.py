"""The access log: one line per request, in the format and at the place the policy says.

``server.access_log`` is ``true`` (stderr, logger ``gateway.access``, as before) or its
settings: ``path`` (a file every worker appends to, reopened on SIGUSR1: ``log_file.py``),
``format`` (``json``, ``text`` or a template of nginx-style ``$variables``), ``fields`` (request
headers the JSON lines carry, so ``gateway replay`` can key on them) and ``raw``. Header values
that are credentials or that a limit reads are written as ``sha256:`` and 12 hex digits of
their hash (``redact.hashed``): equal values hash equal in every worker and every log, so a
replay keys on them as the gateway did, and no API key is written. Query parameters follow the
same rule by their names (``?api_key=`` and ``?token=`` are written hashed, as is a parameter a
``query:NAME`` key part reads).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote_plus

from gateway.edge.request_record import RequestRecord
from gateway.log_setup import JSON_LINE, json_line
from gateway.observability.log_file import LogFile
from gateway.policy.log_template import HEADER_PREFIX, header_of, parse_template
from gateway.policy.models import (
    AccessLogSettings,
    Policy,
    credential_header,
    headers_limits_read,
    query_limits_read,
)
from gateway.redact import hashed

if TYPE_CHECKING:
    from gateway.engine.limit_engine import Outcome

access_logger = logging.getLogger("gateway.access")
JSON_EXTRA: Final = {JSON_LINE: True}
# Query parameter names that carry a credential although the header rule's words miss them.
_CREDENTIAL_PARAMS: Final = frozenset({"sig", "code", "pwd", "pass", "jwt"})
# Hashed header values kept before the table starts afresh (an API key recurs on many lines).
_HASHES_KEPT: Final = 4096
_MONTHS: Final[tuple[str, ...]] = (
    "Jan",
    "Feb",
    "Mar",
    "Apr",
    "May",
    "Jun",
    "Jul",
    "Aug",
    "Sep",
    "Oct",
    "Nov",
    "Dec",
)


def limit_result(outcome: Outcome | None) -> str:
    """The limiter's word on a request, for the access log."""
    if outcome is None:
        return "none"
    if outcome.status:
        return "rejected" if outcome.rejected_by is not None else "denied"
    return "delayed" if outcome.delay_s > 0.0 else "allowed"


class Entry:
    """One finished request, as a line is written from it."""

    __slots__ = (
        "duration_s",
        "ended",
        "outcome",
        "request",
        "route",
        "status",
        "t_us",
        "upstream_error",
    )

    def __init__(
        self,
        request: RequestRecord,
        status: int,
        duration_s: float,
        route: str,
        outcome: Outcome | None,
        upstream_error: str | None,
        t_us: int,
    ) -> None:
        self.request = request
        self.status = status
        self.duration_s = duration_s
        self.route = route
        self.outcome = outcome
        self.upstream_error = upstream_error
        self.t_us = t_us
        self.ended = time.time()


def escaped(text: str) -> str:
    """A value in a template line as nginx writes one: ``"``, ``\\``, control characters and
    bytes beyond ASCII as ``\\xHH``, so a client's header cannot break the line or forge one."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return text
    out: list[str] = []
    for byte in text.encode("utf-8", "surrogateescape"):
        if byte < 0x20 or byte >= 0x7F or byte == 0x22 or byte == 0x5C:
            out.append(f"\\x{byte:02X}")
        else:
            out.append(chr(byte))
    return "".join(out)


def _local_time(moment: float) -> tuple[str, str]:
    """``$time_local`` (``28/Nov/2026:21:22:03 +0000``) and ``$time_iso8601`` of an instant."""
    parts = time.localtime(moment)
    offset = parts.tm_gmtoff or 0
    sign = "-" if offset < 0 else "+"
    hours, minutes = divmod(abs(offset) // 60, 60)
    zone = f"{sign}{hours:02d}{minutes:02d}"
    clock = f"{parts.tm_hour:02d}:{parts.tm_min:02d}:{parts.tm_sec:02d}"
    day = f"{parts.tm_mday:02d}"
    local = f"{day}/{_MONTHS[parts.tm_mon - 1]}/{parts.tm_year}:{clock} {zone}"
    iso = f"{parts.tm_year}-{parts.tm_mon:02d}-{day}T{clock}{sign}{hours:02d}:{minutes:02d}"
    return local, iso


class LineFormat:
    """A policy's access log format, ready to write lines: which headers are carried, which
    of them hashed, and a template's pieces."""

    __slots__ = (
        "_hashed",
        "_hashed_params",
        "_hashes",
        "_raw",
        "_second",
        "_times",
        "fields",
        "kind",
        "pieces",
    )

    def __init__(self, settings: AccessLogSettings, policy: Policy) -> None:
        self.kind = settings.format if settings.format in ("json", "text") else "template"
        keyed, exempt = headers_limits_read(policy)
        raw = {name.lower() for name in settings.raw}
        names = {name.lower() for name in settings.fields}
        self.pieces: tuple[tuple[str, str, str], ...] = ()
        if self.kind == "template":
            # (literal, variable, header it reads or "")
            self.pieces = tuple(
                (literal, variable, header_of(variable) if _is_header(variable) else "")
                for literal, variable in parse_template(settings.format)
            )
            names |= {header for _, _, header in self.pieces if header}
        self._hashed: frozenset[str] = frozenset(
            name
            for name in names
            if name in exempt or ((credential_header(name) or name in keyed) and name not in raw)
        )
        # (name as the policy writes it, lower case) of each header a JSON line carries.
        self.fields: tuple[tuple[str, str], ...] = tuple(
            (name, name.lower()) for name in settings.fields
        )
        self._raw = frozenset(raw)
        self._hashed_params = query_limits_read(policy) - self._raw
        self._hashes: dict[str, str] = {}
        self._second = -1
        self._times = ("", "")

    def header(self, request: RequestRecord, name: str) -> str | None:
        """A request header's value as the log writes it: hashed when it is to be."""
        value = request.headers.get(name)
        if value is None or name not in self._hashed:
            return value
        return self._hash(value)

    def _hash(self, value: str) -> str:
        hashes = self._hashes
        shown = hashes.get(value)
        if shown is None:
            if len(hashes) >= _HASHES_KEPT:
                hashes.clear()
            shown = hashes[value] = hashed(value)
        return shown

    def target(self, raw_path: str) -> str:
        """The request target as the log writes it: each query parameter whose name says it is
        a credential (``api_key``, ``access_token``, ``sig``...), or that a limit reads, with
        its value hashed (the decoded value, as the limit keys on it), unless ``raw`` names it.
        """
        if "?" not in raw_path:
            return raw_path
        path, _, query = raw_path.partition("?")
        if not query:
            return raw_path
        pieces = query.split("&")
        changed = False
        for index, piece in enumerate(pieces):
            name, equals, value = piece.partition("=")
            if not equals or not value or value.startswith("sha256:"):
                continue
            lower = unquote_plus(name).lower()
            if lower in self._raw:
                continue
            if lower in self._hashed_params or credential_param(lower):
                pieces[index] = f"{name}={self._hash(unquote_plus(value))}"
                changed = True
        return f"{path}?{'&'.join(pieces)}" if changed else raw_path

    def line(self, entry: Entry) -> str:
        """The line for one request, without its line break."""
        if self.kind == "template":
            return self._template_line(entry)
        fields = _json_fields(entry, self.target(entry.request.raw_path))
        if self.fields:
            carried: dict[str, str] = {}
            for name, lower in self.fields:
                value = self.header(entry.request, lower)
                if value is not None:
                    carried[name] = value
            if carried:
                fields["headers"] = carried
        if self.kind == "json":
            # One JSON object per line, time included, never behind the text log prefix.
            return json.dumps(json_line(fields), separators=(",", ":"))
        return " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())

    def _template_line(self, entry: Entry) -> str:
        out: list[str] = []
        for literal, variable, header in self.pieces:
            out.append(literal)
            if not variable:
                continue
            if header:
                value = self.header(entry.request, header)
                out.append("-" if value is None else escaped(value))
            else:
                out.append(self._value(entry, variable))
        return "".join(out)

    def _times_of(self, moment: float) -> tuple[str, str]:
        second = int(moment)
        if second != self._second:
            self._second = second
            self._times = _local_time(second)
        return self._times

    def _value(self, entry: Entry, variable: str) -> str:
        """One variable's value (``log_template.VARIABLES``; ``$http_NAME`` is ``header``)."""
        request = entry.request
        outcome = entry.outcome
        if variable == "status":
            return str(entry.status)
        if variable == "remote_addr":
            return escaped(request.client())
        if variable == "request":
            target = self.target(request.raw_path)
            return escaped(f"{request.method} {target} {_protocol(request)}")
        if variable == "time_local":
            return self._times_of(entry.ended)[0]
        if variable == "request_time":
            return f"{entry.duration_s:.3f}"
        if variable == "msec":
            return f"{entry.ended:.3f}"
        if variable == "time_iso8601":
            return self._times_of(entry.ended)[1]
        if variable == "request_method":
            return escaped(request.method)
        if variable == "request_uri":
            return escaped(self.target(request.raw_path))
        if variable == "uri":
            return escaped(request.raw_path.partition("?")[0])
        if variable == "args":
            return escaped(self.target(request.raw_path).partition("?")[2]) or "-"
        if variable == "server_protocol":
            return _protocol(request)
        if variable == "host":
            host = request.headers.get("Host")
            return "-" if host is None else escaped(host)
        if variable == "realip_remote_addr":
            return request.remote() or "-"
        if variable == "remote_user":
            return "-"
        if variable == "route":
            return escaped(entry.route)
        if variable == "limit_result":
            return limit_result(outcome)
        if variable == "limit_name":
            name = outcome.rejected_by if outcome is not None else None
            return "-" if name is None else name
        if variable == "limit_delay_ms":
            return f"{outcome.delay_s * 1000:.3f}" if outcome is not None else "0.000"
        if variable == "upstream_error":
            return entry.upstream_error or "-"
        if variable == "t_us":
            return str(entry.t_us)
        if variable == "pid":
            return str(os.getpid())
        return "-"  # the policy refuses any other name


def credential_param(lower: str) -> bool:
    """Whether a query parameter's (lower-case) name says it holds a credential: the header
    rule's words (key, token, secret, auth, session, password...), and the short names that
    sign URLs (``sig``, ``signature``, ``code``)."""
    return credential_header(lower) or lower in _CREDENTIAL_PARAMS


def _is_header(variable: str) -> bool:
    return variable.startswith(HEADER_PREFIX)


def _protocol(request: RequestRecord) -> str:
    version: Any = request.version
    return f"HTTP/{version[0]}.{version[1]}"


def _json_fields(entry: Entry, target: str) -> dict[str, Any]:
    """The fields of a JSON (or text) line. ``ts`` is the wall-clock arrival (epoch seconds,
    microseconds); ``t_us`` the limiter's clock (monotonic, integer microseconds) at the
    instant the limits decided the request, or at its arrival when no limit did: what
    ``gateway replay`` decides the request at, so a replay of this log gives the same
    decisions."""
    request = entry.request
    outcome = entry.outcome
    duration_s = entry.duration_s
    fields: dict[str, Any] = {
        "ts": round(entry.ended - duration_s, 6),
        "t_us": entry.t_us,
        "client": request.client(),
        "method": request.method,
        "host": request.headers.get("Host"),
        "path": target,
        "status": entry.status,
        "duration_ms": round(duration_s * 1000, 3),
        "route": entry.route,
        "limit": limit_result(outcome),
        "limit_name": outcome.rejected_by if outcome is not None else None,
        "delay_ms": round(outcome.delay_s * 1000, 3) if outcome is not None else 0.0,
        "upstream_error": entry.upstream_error,
    }
    costs = request.reported_costs
    if costs is not None:  # what the upstream said the request cost: a replay charges it
        fields["costs"] = costs
    return fields


def _logfmt(value: object) -> str:
    if value is None:
        return "-"
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return json.dumps(text)
    return text


class AccessLog:
    """One worker's access log: the format in force and where its lines go (stderr, through
    logger ``gateway.access``, or a file). ``configure`` follows the policy (start, reload)."""

    __slots__ = ("_file", "_format")

    def __init__(self) -> None:
        self._format: LineFormat | None = None
        self._file: LogFile | None = None

    @property
    def on(self) -> bool:
        return self._format is not None

    @property
    def path(self) -> str | None:
        return self._file.path if self._file is not None else None

    def configure(self, policy: Policy) -> None:
        """Write as ``policy`` says from now on (its ``path`` made absolute by the loader).
        OSError, and nothing changed, if a new file cannot be opened."""
        self.use(policy, self.open_for(policy))

    def open_for(self, policy: Policy) -> LogFile | None:
        """The file ``policy`` names, opened: the one in use when the path is the same, else
        a new one (OSError if it cannot be opened). None for stderr or no access log."""
        settings = policy.server.access_log_settings()
        path = settings.path if settings is not None else None
        if path is None:
            return None
        current = self._file
        return current if current is not None and current.path == path else LogFile(path)

    def use(self, policy: Policy, log_file: LogFile | None) -> None:
        """Write as ``policy`` says, to ``log_file`` (``open_for``'s), from now on."""
        settings = policy.server.access_log_settings()
        previous, self._file = self._file, log_file
        if previous is not None and previous is not log_file:
            previous.close()
        self._format = LineFormat(settings, policy) if settings is not None else None

    def discard(self, log_file: LogFile | None) -> None:
        """A file ``open_for`` opened for a policy that is not applied after all."""
        if log_file is not None and log_file is not self._file:
            log_file.close()

    def reopen(self) -> str:
        """Reopen the file (SIGUSR1, after logrotate renamed it); what was done, in words.
        OSError when the path cannot be opened (the old file is kept)."""
        if self._file is None:
            return "no access log file to reopen (the access log is off or on stderr)"
        self._file.reopen()
        return f"access log {self._file.path} reopened"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def write(
        self,
        request: RequestRecord,
        status: int,
        duration_s: float,
        route: str,
        outcome: Outcome | None,
        upstream_error: str | None,
        t_us: int,
    ) -> None:
        line_format = self._format
        if line_format is None:
            return
        line = line_format.line(
            Entry(request, status, duration_s, route, outcome, upstream_error, t_us)
        )
        log_file = self._file
        if log_file is not None:
            log_file.write((line + "\n").encode("utf-8", "backslashreplace"))
        elif line_format.kind == "text":
            access_logger.info(line)
        else:
            access_logger.info(line, extra=JSON_EXTRA)
