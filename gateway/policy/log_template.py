"""The access log's line templates (``server.access_log.format``): nginx-style ``$variables``.

A template is text with ``$name`` (or ``${name}``) where a request's value goes, as nginx's
``log_format``. Parsed once, when the policy is loaded: an unknown variable is a policy error,
never a line written with a hole in it. The values are filled in by
``gateway/observability/access_log.py``, which holds a writer for each name listed here.
"""

from __future__ import annotations

import re
from typing import Final

# Every variable a template may name, with what it holds (the reference lists them). Request
# headers are ``$http_NAME``: NAME lower-case, with ``_`` for ``-`` (``$http_x_api_key``).
VARIABLES: Final[dict[str, str]] = {
    "remote_addr": "the client's address (behind trusted_proxies, the one they name)",
    "realip_remote_addr": "the address of the connection's peer",
    "remote_user": "always - (the gateway reads no user name)",
    "time_local": "when the request ended, local time: 28/Nov/2026:21:22:03 +0000",
    "time_iso8601": "when the request ended, ISO 8601: 2026-11-28T21:22:03+00:00",
    "msec": "when the request ended, epoch seconds with milliseconds",
    "request": "the request line: GET /path?query HTTP/1.1",
    "request_method": "the method",
    "request_uri": "the target as sent, query included",
    "uri": "the path, without the query",
    "args": "the query, without the ?",
    "server_protocol": "HTTP/1.1 or HTTP/1.0",
    "host": "the Host header",
    "status": "the response's status",
    "request_time": "seconds the request took, with milliseconds",
    "route": "the route's name",
    "limit_result": "allowed, delayed, rejected, denied or none",
    "limit_name": "the limit that rejected the request",
    "limit_delay_ms": "milliseconds the limits delayed the request",
    "upstream_error": "why the upstream failed (connect, timeout, reset, protocol, other)",
    "t_us": "the limiter's instant (what gateway replay decides the request at)",
    "pid": "the worker's process id",
}
HEADER_PREFIX: Final = "http_"
# Variables nginx has and the gateway does not record: named with what to write instead.
NOT_RECORDED: Final[dict[str, str]] = {
    "body_bytes_sent": "the gateway does not count the bytes of each response: write - "
    "in its place",
    "bytes_sent": "the gateway does not count the bytes of each response: write - in its place",
}

_VARIABLE: Final = re.compile(r"\$(?:\{([A-Za-z0-9_]+)\}|([A-Za-z0-9_]+))")


def is_template(text: str) -> bool:
    """Whether a ``format`` is a template (it names a variable), not ``json`` or ``text``."""
    return "$" in text


def parse_template(text: str) -> tuple[tuple[str, str], ...]:
    """A template as (literal text, variable name) pairs, in order; the last pair's variable
    is "" when the template ends with text. ValueError naming an unknown variable."""
    pieces: list[tuple[str, str]] = []
    at = 0
    for found in _VARIABLE.finditer(text):
        name = found.group(1) or found.group(2)
        check_variable(name)
        pieces.append((text[at : found.start()], name))
        at = found.end()
    rest = text[at:]
    if "$" in rest or any("$" in literal for literal, _ in pieces):
        raise ValueError(
            "a $ that names no variable: write $name or ${name} (a literal $ cannot be written)"
        )
    if rest:
        pieces.append((rest, ""))
    if "\n" in text or "\r" in text:
        raise ValueError("a template is one line: it holds no line break")
    return tuple(pieces)


def check_variable(name: str) -> None:
    """ValueError, saying what to write instead, unless ``name`` is a variable."""
    if name in VARIABLES:
        return
    if name.startswith(HEADER_PREFIX) and len(name) > len(HEADER_PREFIX):
        return
    if name in NOT_RECORDED:
        raise ValueError(f"${name}: {NOT_RECORDED[name]}")
    raise ValueError(
        f"unknown variable ${name}: expected $http_NAME (a request header) or one of "
        + ", ".join("$" + known for known in VARIABLES)
    )


def header_of(variable: str) -> str:
    """The request header ``$http_NAME`` reads: ``http_x_api_key`` -> ``x-api-key``."""
    return variable[len(HEADER_PREFIX) :].replace("_", "-")
