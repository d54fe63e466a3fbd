"""The private aiohttp attributes the edge relies on (``gateway/edge/aiohttp_private.py``) still
exist: an aiohttp upgrade that renames one fails here, not in production."""

from __future__ import annotations

import inspect

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.test_utils import make_mocked_request
from aiohttp.web_protocol import RequestHandler
from multidict import CIMultiDictProxy

from gateway.edge.aiohttp_private import (
    CONNECTION_PROPERTIES,
    HANDLER_ATTRIBUTES,
    MESSAGE_ATTRIBUTES,
    REQUEST_ATTRIBUTES,
    RESPONSE_ATTRIBUTES,
    ErrInfo,
    error_request,
)


def _attributes(cls: type) -> set[str]:
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(getattr(klass, "__slots__", ()))
    return names


def test_request_handler_has_the_slots_the_protocol_uses() -> None:
    assert set(HANDLER_ATTRIBUTES) <= _attributes(RequestHandler)
    assert set(CONNECTION_PROPERTIES) <= _attributes(RequestHandler)


def test_responses_have_the_internals_the_relayed_responses_wrap() -> None:
    for response in (web.StreamResponse(), web.Response()):
        assert all(hasattr(response, name) for name in RESPONSE_ATTRIBUTES)
    assert inspect.iscoroutinefunction(web.StreamResponse._prepare_headers)


def test_a_parse_error_entry_carries_its_message() -> None:
    assert "message" in inspect.signature(ErrInfo).parameters


def test_a_request_and_its_message_have_what_the_loop_and_the_record_use() -> None:
    request = make_mocked_request("GET", "/x", headers={"Host": "h"})
    assert all(hasattr(request, name) for name in REQUEST_ATTRIBUTES)
    message = request._message
    assert message.path == "/x" and message.upgrade is False and message.chunked is False
    # Under aiohttp's C parser (production) the message is its own class, not the NamedTuple
    # the stubs declare: why compiled code reads it untyped.
    assert {"method", "path", "upgrade", "chunked"} <= set(dir(RawRequestMessage))
    assert set(MESSAGE_ATTRIBUTES) <= set(dir(RawRequestMessage))
    assert set(MESSAGE_ATTRIBUTES) <= set(dir(error_request()))


def test_the_placeholder_for_an_unparsed_request_has_a_parsed_messages_types() -> None:
    """The request loop makes the gateway's record of it (compiled, the record's fields are
    type-checked: aiohttp's own placeholder holds two dicts, and its connection hung)."""
    message = error_request()
    assert isinstance(message.raw_headers, tuple)
    assert isinstance(message.headers, CIMultiDictProxy)
    assert (message.path, message.should_close) == ("/", True)
