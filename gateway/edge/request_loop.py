"""aiohttp's request loop for one client connection, with each request's handler awaited in the
connection's own task rather than a task of its own, and compiled with the rest of the request
path.

aiohttp's ``RequestHandler.start`` (3.14.5) wraps each request in a new task: an eager one on
Python 3.12 and later, which runs at once, but on 3.11 a task scheduled for the next turn of the
loop, with its context copied, its registration in asyncio's set of tasks and a second turn to
wake the connection's task when it is done: some 12,000 instructions a request, about 5 % of
one proxied request (bench/README.md, "aiohttp's per-request machinery"). This is the same loop
(the same steps, in the same order, on the same aiohttp attributes, named in
``aiohttp_private``) awaiting the handler directly, with aiohttp's ``_handle_request`` and the
common case of its ``finish_response`` (compiled, some 6,000 instructions a request fewer than
aiohttp's interpreted pair). Cancellation is unchanged: a client gone
cancels the connection's task (``handler_cancellation``), which is the task the handler runs
in. What changes is that one connection's requests share one context: nothing on the request
path sets a context variable.

Each request is handed to the handler as the gateway's own record (``request_record``), made
here from aiohttp's parsed message, when the handler takes one (the proxy's ``serve_record``);
aiohttp's ``BaseRequest`` and its writer are made only where aiohttp's own code needs them (one
of its responses to prepare, an error answer, its access log), and a response the gateway wrote
itself (``PreparedResponse``) is sent without one (some 17,000 instructions a request fewer:
bench/README.md, "Sixth round").
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.helpers import ceil_timeout
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_exceptions import HTTPException
from aiohttp.web_protocol import RequestHandler

from gateway.edge.aiohttp_private import PAYLOAD_ACCESS_ERROR, ErrInfo, error_request
from gateway.edge.request_record import RequestRecord
from gateway.edge.responses import PreparedResponse


async def serve_connection(protocol: RequestHandler) -> None:
    """Serve the connection's requests one after another until it closes (``start``)."""
    loop: Any = protocol._loop
    manager = protocol._manager
    assert manager is not None
    while not protocol._force_close:
        if not protocol._messages:
            try:
                # wait for next request
                protocol._waiter = loop.create_future()
                await protocol._waiter
            finally:
                protocol._waiter = None
        # Untyped: under aiohttp's C parser the message is not the NamedTuple its stubs say.
        entry: Any = protocol._messages.popleft()
        _message_taken(protocol)
        # time is only fetched if logging is enabled
        start = loop.time() if protocol._logging_enabled else None
        manager.requests_count += 1
        if not await _serve_request(protocol, loop, entry[0], entry[1], start):
            break
        if protocol._keepalive and not protocol._close and not protocol._force_close:
            _keep_alive(protocol, loop)
        else:
            break
    # remove handler, close transport if no handlers left
    if not protocol._force_close:
        protocol._task_handler = None
        if protocol.transport is not None:
            protocol.transport.close()


def _message_taken(protocol: RequestHandler) -> None:
    """Free a parser slot; resume reading once the queue drains, so pipelining keeps flowing."""
    parser: Any = protocol._parser
    if parser is not None:
        parser.message_consumed()
    if protocol._buffer_paused and len(protocol._messages) <= protocol._msg_queue_resume_size:
        protocol._resume_reading_if_drained()


async def _serve_request(
    protocol: RequestHandler, loop: Any, message: Any, payload: StreamReader, start: Any
) -> bool:
    """One request, its handler awaited here; False when the connection is done with."""
    serve_record: Any = None
    if isinstance(message, ErrInfo):
        # make request_factory work
        handler: Any = protocol._make_error_handler(message)
        message = error_request()
    else:
        handler = protocol._request_handler
        gateway: Any = protocol
        serve_record = gateway.serve_record
    # The loop runs only ``server.GatewayProtocol`` connections: the record's listener.
    listener: Any = protocol
    record = RequestRecord(message, payload, protocol, listener)
    try:
        try:
            response, reset = await _handle_request(protocol, record, start, handler, serve_record)
        except ConnectionError:
            protocol.log_debug("Ignored premature client disconnection")
            return False
        if reset:
            protocol.log_debug("Ignored premature client disconnection 2")
            return False
        # notify server about keep-alive
        protocol._keepalive = bool(response.keep_alive)
        # aiohttp's shared empty body (a request without one) is always at its end and takes
        # no exception: two interpreted calls a request spared.
        if payload is not EMPTY_PAYLOAD:
            if not payload.is_eof():
                await _linger(protocol, loop, payload)
            payload.set_exception(PAYLOAD_ACCESS_ERROR)
    except asyncio.CancelledError:
        protocol.log_debug("Ignored premature client disconnection")
        protocol.force_close()
        raise
    except Exception as exc:
        protocol.log_exception("Unhandled exception", exc_info=exc)
        protocol.force_close()
    except BaseException:
        protocol.force_close()
        raise
    finally:
        made: Any = record.made_request()
        if made is not None:
            made._task = None  # break the reference cycle in case of an exception
    return True


async def _handle_request(
    protocol: RequestHandler, record: RequestRecord, start: Any, handler: Any, serve_record: Any
) -> tuple[Any, bool]:
    """aiohttp's ``_handle_request``: the handler's response, or the error response for its
    failure, prepared and sent; True with it when the client went away meanwhile."""
    protocol._request_in_progress = True
    try:
        response = await _response_of(protocol, record, handler, serve_record)
        return await _finish_response(protocol, record, response, start)
    finally:
        protocol._request_in_progress = False
        waiter = protocol._handler_waiter
        if waiter is not None:
            waiter.set_result(None)


async def _response_of(
    protocol: RequestHandler, record: RequestRecord, handler: Any, serve_record: Any
) -> Any:
    """What the handler answers, or the answer to its failure, made in the ``except`` clause
    (so the error is logged with it) and sent after it: compiled, a coroutine does not await
    in an ``except`` clause (tests/test_build.py). A handler that reads the gateway's record
    (the proxy's ``serve_record``) gets it; any other gets aiohttp's request."""
    # Untyped: aiohttp's stubs say a ``BaseRequest``; the record stands in for it (``_cancel``).
    connection: Any = protocol
    try:
        try:
            connection._current_request = record
            if serve_record is not None:
                return await serve_record(record)
            return await handler(record.aiohttp_request())
        finally:
            connection._current_request = None
    except HTTPException as http_exception:
        return http_exception
    except TimeoutError as timeout:
        protocol.log_debug("Request handler timed out.", exc_info=timeout)
        return protocol.handle_error(record.aiohttp_request(), 504)
    except Exception as failure:
        return protocol.handle_error(record.aiohttp_request(), 500, failure)


async def _finish_response(
    protocol: RequestHandler, record: RequestRecord, response: Any, start: Any
) -> tuple[Any, bool]:
    """aiohttp's ``finish_response`` for a response to send; an upgrade declined (whose
    buffered tail is parsed there) or a handler that returned no response goes to aiohttp's.
    The gateway's own bytes (``PreparedResponse``) are written without aiohttp's request."""
    if protocol._upgraded or not hasattr(response, "prepare"):
        return await protocol.finish_response(record.aiohttp_request(), response, start)
    made = record.made_request()
    if made is not None:
        made._finish()
    try:
        if isinstance(response, PreparedResponse):
            response.send(record.transport)
        else:
            await response.prepare(record.aiohttp_request())
            await response.write_eof()
    except ConnectionError:
        _log_access(protocol, record, response, start)
        return response, True
    _log_access(protocol, record, response, start)
    return response, False


def _log_access(protocol: RequestHandler, record: RequestRecord, response: Any, start: Any) -> None:
    """aiohttp's access log line, where one is configured (the gateway writes its own)."""
    if protocol._logging_enabled:
        protocol.log_access(record.aiohttp_request(), response, start)


async def _linger(protocol: RequestHandler, loop: Any, payload: StreamReader) -> None:
    """Read and drop what is left of a body the handler did not read, for up to the lingering
    time, so that the client reads the answer rather than a reset; else close after it."""
    lingering_time = protocol._lingering_time
    if not protocol._force_close and lingering_time:
        protocol.log_debug("Start lingering close timer for %s sec.", lingering_time)
        now = loop.time()
        end_t = now + lingering_time
        try:
            while not payload.is_eof() and now < end_t:
                async with ceil_timeout(end_t - now):
                    await payload.readany()  # read and ignore
                now = loop.time()
        except (TimeoutError, asyncio.CancelledError):
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
    # if payload still uncompleted
    if not payload.is_eof() and not protocol._force_close:
        protocol.log_debug("Uncompleted request.")
        protocol.close()


def _keep_alive(protocol: RequestHandler, loop: Any) -> None:
    """Move the connection's idle deadline on; its one timer is armed only when it has none
    (when it fires early it re-arms itself for the deadline)."""
    close_time = loop.time() + protocol._keepalive_timeout
    protocol._next_keepalive_close_time = close_time
    if protocol._keepalive_handle is None:
        protocol._keepalive_handle = loop.call_at(close_time, protocol._process_keepalive)
