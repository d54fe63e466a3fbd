"""What the edge takes from aiohttp's insides, named in one place, and the subclasses that
reach into them.

aiohttp's low-level server has no public hook for these. An aiohttp upgrade that renames one
fails ``tests/test_aiohttp_private.py``, not production. This module stays interpreted (its
classes derive from aiohttp's and from ``list``, which mypyc does not compile); nothing here
runs per request but ``MessageQueue``'s two list operations.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import hdrs, web
from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR, ERROR, _ErrInfo
from multidict import CIMultiDict, CIMultiDictProxy

# A parse error aiohttp queues in ``RequestHandler._messages`` in place of a request.
ErrInfo: Final = _ErrInfo

# The error a request's body is failed with once its handler is done.
PAYLOAD_ACCESS_ERROR: Final = _PAYLOAD_ACCESS_ERROR

# ``RequestHandler`` slots and methods ``GatewayProtocol`` and its request loop
# (``gateway/edge/request_loop.py``, aiohttp's ``RequestHandler.start``) read or replace.
HANDLER_ATTRIBUTES: Final = (
    "_messages",
    "_keepalive_handle",
    "_loop",
    "_manager",
    "_parser",
    "_buffer_paused",
    "_msg_queue_resume_size",
    "_logging_enabled",
    "_request_factory",
    "_request_handler",
    "_task_handler",
    "_force_close",
    "_close",
    "_keepalive",
    "_keepalive_timeout",
    "_next_keepalive_close_time",
    "_lingering_time",
    "_waiter",
    "_request_in_progress",
    "_handler_waiter",
    "_current_request",
    "_upgraded",
    "finish_response",
    "log_access",
    "_make_error_handler",
    "_resume_reading_if_drained",
    "_process_keepalive",
)
# ``StreamResponse`` internals the relayed responses wrap.
RESPONSE_ATTRIBUTES: Final = ("_prepare_headers", "_headers", "_eof_sent")
# What the request loop calls on a ``BaseRequest`` it made (``_finish``, ``_task``), and what
# aiohttp calls on the request its connection serves (``_cancel``), which the gateway's record
# stands in for.
REQUEST_ATTRIBUTES: Final = ("_task", "_finish", "_cancel")
# What the gateway's record reads of a parsed message (a C ``RawRequestMessage`` under aiohttp's
# C parser, not the NamedTuple its stubs declare: read untyped).
MESSAGE_ATTRIBUTES: Final = (
    "method",
    "path",
    "version",
    "should_close",
    "upgrade",
    "raw_headers",
    "headers",
    "url",
    "chunked",
)
# The connection's peer and TLS context, read once a connection (the record reads them).
CONNECTION_PROPERTIES: Final = ("peername", "ssl_context")


# aiohttp's placeholder message for a request it could not parse holds its headers as two
# dicts; a parsed message's are a ``CIMultiDictProxy`` and a tuple, which the gateway's record
# (compiled: its fields' types are checked) takes.
_ERROR_MESSAGE: Final = ERROR._replace(headers=CIMultiDictProxy(CIMultiDict()), raw_headers=())


def error_request() -> Any:
    """The message the request loop builds the request from for a request aiohttp could not
    parse: aiohttp's, its headers typed as a parsed message's; untyped, as a parsed one is
    (``MESSAGE_ATTRIBUTES``)."""
    return _ERROR_MESSAGE


class MessageQueue(list[Any]):
    """aiohttp's per-connection queue of parsed requests, as a list: an empty ``deque`` is many
    times the size of an empty list, and this queue holds one or two entries (pipelining), on
    every connection a shaping queue holds (bench/README.md)."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)


class _Relayed:
    """Sends the upstream's headers as they came: aiohttp would add ``Content-Type:
    application/octet-stream`` and ``Server: Python/... aiohttp/...`` (versions) where the
    upstream sent none, and only on the responses that take this path (large, streamed)."""

    async def _prepare_headers(self) -> None:
        headers: CIMultiDict[str] = self._headers  # type: ignore[attr-defined]
        had_type = hdrs.CONTENT_TYPE in headers
        had_server = hdrs.SERVER in headers
        await super()._prepare_headers()  # type: ignore[misc]
        if not had_type:
            headers.popall(hdrs.CONTENT_TYPE, None)
        if not had_server:
            headers.popall(hdrs.SERVER, None)


class RelayedStream(_Relayed, web.StreamResponse):
    def cut(self, transport: asyncio.BaseTransport | None) -> None:
        """End the response by closing its connection, short of its framing (no last chunk,
        fewer bytes than its ``Content-Length``): how a client learns that a body whose headers
        are sent is incomplete. aiohttp's ``write_eof`` after the handler is then a no-op, not
        a write to a closed transport."""
        self.force_close()
        self._eof_sent = True
        if transport is not None:
            transport.close()


class RelayedResponse(_Relayed, web.Response):
    pass
