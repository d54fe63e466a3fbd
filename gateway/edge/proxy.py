"""The request handler: check, route, resolve the client, forward, stream the answer back."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, cast

from aiohttp import HttpVersion, HttpVersion10, HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from gateway.edge.adaptive_gate import AdaptiveGate
from gateway.edge.aiohttp_private import RelayedResponse, RelayedStream
from gateway.edge.annotations import upstream_error_reason
from gateway.edge.forwarding import (
    BadFraming,
    BadRequest,
    ForwardedFor,
    RequestFraming,
    build_request_head,
    check_request,
    response_head,
    response_headers,
)
from gateway.edge.next_upstream import hash_key, read_whole, send, should_buffer
from gateway.edge.rejection_response import custom_rejection_response
from gateway.edge.request_record import RequestRecord
from gateway.edge.response_usage import usage_meter, usage_reported
from gateway.edge.responses import (
    SERVER,
    HttpDate,
    PreparedResponse,
    rate_limited_response,
    version_not_supported,
)
from gateway.edge.server import ChunkTooLarge
from gateway.edge.upstream_client import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.edge.websocket import forward_upgrade, wants_upgrade
from gateway.engine.delay_queue import ShuttingDown
from gateway.limits.compiled import Check, hold_in_flight
from gateway.limits.keys import RequestFacts
from gateway.limits.routing import (
    RefusedTarget,
    RouteEntry,
    normalise_host,
    origin_form,
    routing_path,
)
from gateway.limits.usage import BATCH_BYTES, UsageMeter

if TYPE_CHECKING:
    from gateway.edge.pool.server_pool import PoolMember, ServerPool
    from gateway.edge.runtime import Runtime, UpstreamTarget
    from gateway.engine.limit_engine import Outcome

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DATE = HttpDate()
_NO_BODY_STATUS = frozenset({204, 304})
# A request refused for its token (``jwt.on_missing``/``on_invalid: 401``), RFC 6750.
_BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    """The client stopped sending its body (nginx's client_body_timeout)."""


class BodyBroken(Exception):
    """The client's body went bad while streaming (bad chunking, trailers); aiohttp said why."""


class _Admitted:
    """What forwarding an admitted request needs: all of ours a request keeps while queued."""

    __slots__ = (
        "body",
        "forwarded",
        "framing",
        "meter",
        "outcome",
        "reported",
        "route",
        "sent_status",
        "target",
        "upstream",
    )

    def __init__(
        self,
        route: RouteEntry,
        upstream: UpstreamTarget,
        target: str,
        framing: RequestFraming,
        forwarded: ForwardedFor,
        outcome: Outcome | None,
    ) -> None:
        self.route = route
        self.upstream = upstream
        self.target = target  # origin-form (or "*"), as sent upstream after the base path
        self.framing = framing
        self.forwarded = forwarded
        self.outcome = outcome  # of the limits, for the rate-limit headers and queueing
        # The cost headers the upstream's response held (limits charged after the response).
        self.reported: dict[bytes, bytes] | None = None
        # The status of a streamed answer whose head the client has: what limits counted by
        # their responses charge, even if the client leaves in the middle of the body.
        self.sent_status = 0
        # What the body says the request cost (``cost_from``), read as it is relayed.
        self.meter: UsageMeter | None = None
        # The request body, when part of it was read before the limits decided (a key part
        # ``body:FIELD``): forwarded from there, unchanged.
        self.body: RequestBody | None = None


class _Refused:
    """A request the limits refused: the answer, sent by the handler, and the outcome the
    observer counts."""

    __slots__ = ("framing", "outcome", "response")

    def __init__(self, response: web.Response, outcome: Outcome, framing: RequestFraming) -> None:
        self.response = response
        self.outcome = outcome
        self.framing = framing


class ProxyHandler:
    """Holds the current runtime snapshot; a reload swaps ``runtime`` in one assignment."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # Told about every finished request (its record, status, seconds, the limits' outcome
        # if they decided it): the metrics and access log. The outcome is handed over here
        # rather than kept on the record: not every request has one.
        self.observer: Callable[[RequestRecord, int, float, Outcome | None], None] | None = None

    async def serve_record(self, record: RequestRecord) -> web.StreamResponse:
        """Answer one request: what the proxy and the observer read of it was read once, into
        ``record``, which the listener's request loop makes (``request_loop``)."""
        started = perf_counter()
        listener = record.listener
        if listener is not None:
            listener.request_started(record.content)
        runtime = self.runtime
        runtime.inflight += 1
        status = 500
        admitted: web.StreamResponse | _Admitted | _Refused | None = None
        response: web.StreamResponse
        # The checks whose holds this request counts in flight (``hold_in_flight``).
        holding: Sequence[Check] = ()
        try:
            # Admit, wait, forward: a request in the shaping queue holds this one coroutine of
            # ours and what ``_admit`` kept for forwarding, not the frames that decided it
            # (each some 300-500 bytes, and 10,000 may wait at once).
            admitted = await self._admit(record, runtime)
            if isinstance(admitted, _Refused):
                response = await _refuse(record, admitted.response, admitted.framing)
            elif not isinstance(admitted, _Admitted):
                response = admitted
            else:
                outcome = admitted.outcome
                if outcome is not None and outcome.charge_after:
                    holding = outcome.charge_after
                    hold_in_flight(holding, 1)
                if outcome is not None and outcome.delay_s > 0.0:
                    _request_waits(record)
                    await _wait_in_queue(runtime, outcome)
                if record.upgrade and wants_upgrade(record, admitted.framing, runtime):
                    response = await forward_upgrade(
                        record,
                        runtime,
                        admitted.upstream,
                        admitted.target,
                        admitted.framing,
                        admitted.forwarded,
                        outcome,
                    )
                else:
                    response = await self._forward(record, runtime, admitted)
            status = response.status
            return response
        except ShuttingDown:
            status = 503
            record.local_answer = True
            return runtime.error_response(
                503, "the gateway is shutting down", close=True, headers={"Retry-After": "1"}
            )
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            if holding:
                hold_in_flight(holding, -1)
            outcome = None
            if isinstance(admitted, _Admitted):
                outcome = admitted.outcome
                if outcome is not None:
                    _settle_limits(record, runtime, admitted, outcome, status)
            elif isinstance(admitted, _Refused):
                outcome = admitted.outcome
                runtime.engine.give_back_holds(outcome)
            runtime.request_done()
            if listener is not None:
                listener.request_finished()
            observer = self.observer
            if observer is not None:
                observer(record, status, perf_counter() - started, outcome)

    async def _admit(
        self, request: RequestRecord, runtime: Runtime
    ) -> web.StreamResponse | _Admitted | _Refused:
        """Check the request, route it, resolve the client and ask the limits: a response that
        ends the request here, the limits' refusal, or what forwarding it needs (after its
        delay, if any)."""
        version = request.version
        if version != HttpVersion11 and version != HttpVersion10:
            # llhttp also parses 0.9 and 2.0 request lines; aiohttp would answer in that version.
            return _answer_raw_and_close(request, version_not_supported(runtime.legacy_error_body))
        try:
            framing = check_request(request.raw_headers, version)
        except BadFraming as bad_framing:
            # Where this body ends is unknown: reading on for aiohttp's lingering close would
            # hold the connection for up to 10 s to no purpose.
            return await _answer_and_close(
                request, runtime.error_response(bad_framing.status, bad_framing.reason, close=True)
            )
        except BadRequest as bad_request:
            return runtime.error_response(bad_request.status, bad_request.reason, close=True)
        method = request.method
        if method == "CONNECT":
            return runtime.error_response(405, "CONNECT is not supported", close=True)
        host_header = request.headers.get("Host")
        try:
            target = origin_form(request.raw_path, method, host_header)
        except RefusedTarget as refused:
            return runtime.error_response(400, str(refused), close=True)

        host = normalise_host(host_header)
        path = routing_path(target)
        route = runtime.routes.entry(host, path, method)
        if route is None:
            return runtime.error_response(404, "no route matches this request")
        request.route_name = route.name
        admitted = _Admitted(
            route,
            runtime.upstreams[route.upstream],
            target,
            framing,
            _forwarded_for(request, runtime, host_header),
            None,
        )
        engine = runtime.engine
        if not engine.active:
            return admitted
        client_ip = admitted.forwarded.client_ip
        facts = RequestFacts.of(
            client_ip,
            engine.ipv6_prefix,
            route.name,
            method,
            request.headers,
            request.query,
        )
        if engine.reads_body and framing.has_body:
            too_large = await _read_body_for_keys(request, runtime, admitted, facts)
            if too_large is not None:
                return too_large
        if engine.identity is not None and engine.keys_pending(facts):
            await engine.await_keys(facts)  # a new kid: the key set fetched, bounded
        # Without a wait where the store decides at once: no coroutine per request.
        if engine.decides_now:
            outcome = engine.evaluate_now(facts, route.config, host, path, client_ip)
        else:
            outcome = await engine.evaluate(facts, route.config, host, path, client_ip)
        if outcome.waits_on is not None:  # over a concurrency limit: in line for a slot
            _request_waits(request)
            outcome = await engine.wait_for_slot(outcome)
        if outcome.status:
            return _Refused(_limits_refusal(runtime, outcome, framing), outcome, framing)
        admitted.outcome = outcome
        return admitted

    async def _forward(
        self, request: RequestRecord, runtime: Runtime, admitted: _Admitted
    ) -> web.StreamResponse:
        """Send the admitted request to its upstream (past its adaptive limit, if any) and the
        upstream's answer back to the client."""
        framing = admitted.framing
        outcome = admitted.outcome
        limit_headers = (
            runtime.engine.header_block(outcome)
            if outcome is not None and outcome.verdict is not None
            else b""
        )
        route = admitted.route
        max_body = route.max_body_size
        if _body_refused(request, framing, max_body):
            return await _refuse_body(request, runtime, framing, max_body)
        upstream = admitted.upstream
        # The upstream's adaptive limit (this worker's): a place before the request goes out,
        # given back once its response is in; beyond it, a wait or the answer at once.
        gate = upstream.gate
        started_us = 0
        if gate is not None:
            if not gate.try_enter() and not await gate.enter():
                request.local_answer = True
                return await _refuse(
                    request, _shed_response(gate, upstream.name, framing, runtime), framing
                )
            started_us = gate.started()

        read_ahead = admitted.body
        if framing.expect_continue and request.transport is not None and read_ahead is None:
            request.transport.write(_CONTINUE)
        pool = upstream.pool
        method = request.method
        measured = False  # the response (or a timeout) tells the adaptive limit a latency
        try:
            body: RequestBody | bytes | None = read_ahead
            if body is None and framing.has_body:
                body = RequestBody(request, max_body, runtime.body_timeout)
                if should_buffer(pool, method, framing.content_length):
                    body = await read_whole(body)
            response, server = await send(
                pool,
                method,
                _head_builder(request, runtime, admitted),
                body,
                body_chunked=framing.chunked,
                expect_no_body=method == "HEAD",
                key=hash_key(
                    request,
                    pool,
                    route.name,
                    admitted.forwarded.client_ip,
                    runtime.engine.ipv6_prefix,
                ),
                connect_timeout_s=route.connect_timeout,
                read_timeout_s=route.read_timeout,
            )
            measured = True
        # One name per handler: compiled, a name several clauses bind takes the first's type.
        except (BodyTooLarge, BodyTimeout, BodyBroken) as body_failure:
            return await _body_failed(request, runtime, body_failure)
        except UpstreamError as upstream_error:  # the pool logged each server's failure
            measured = isinstance(upstream_error, UpstreamTimeout)
            return _upstream_failed(request, runtime, upstream.name, upstream_error)
        finally:
            if gate is not None:  # whatever ended it, the client gone too
                gate.release(started_us, measured=measured)

        meter = _read_costs(request, runtime, admitted, response)
        try:
            if _whole_at_once(response, method, request.version):
                return _whole_answer(request, runtime, response, meter, limit_headers)
            return await _relayed_answer(
                request, runtime, admitted, response, server, meter, limit_headers
            )
        finally:
            response.close()
            pool.finished(server)


def _request_waits(request: RequestRecord) -> None:
    """The request is about to wait for the limits: its connection drops its idle timer."""
    listener = request.listener
    if listener is not None:
        listener.request_waits()


async def _wait_in_queue(runtime: Runtime, outcome: Outcome) -> None:
    """Wait out the limits' delay in the shaping queue; a request cancelled or shut down there
    gives its charge back (it never reached the upstream), then fails as it was stopped.

    The charge is given back after the ``except`` clause, not awaited in it: compiled, the
    exception being handled is kept in the thread's state, not the coroutine's; the awaiting
    handler resets that state while this coroutine is suspended, and a bare ``raise`` after
    the ``await`` raised nothing (the handler missed the cancellation, then crashed)."""
    engine = runtime.engine
    stopped: BaseException | None = None
    try:
        try:
            await engine.enter_queue(outcome)
        except (asyncio.CancelledError, ShuttingDown) as stop:
            stopped = stop
        if stopped is not None:
            await engine.give_back(outcome)
            engine.give_back_holds(outcome)  # it never reached the upstream
            raise stopped
    finally:
        engine.leave_queue(outcome)


def _settle_limits(
    request: RequestRecord, runtime: Runtime, admitted: _Admitted, outcome: Outcome, status: int
) -> None:
    """What a finished request owes its limits: its concurrency slots back (the response
    sent, the client gone, the upstream failed or a WebSocket closed), and the charges made
    after the response: the status the client got (499 if it left before the head) and what
    the upstream said the request cost. Never awaited by the response."""
    if outcome.held:
        runtime.engine.release(outcome)
    if outcome.charge_after:
        if admitted.meter is not None:
            admitted.reported = usage_reported(
                request, admitted.meter, admitted.reported, runtime.usage_log
            )
        runtime.engine.charge_after(outcome, admitted.sent_status or status, admitted.reported)


def _forwarded_for(
    request: RequestRecord, runtime: Runtime, host_header: str | None
) -> ForwardedFor:
    """Who the client is (recorded on the request) and the forwarding facts sent upstream."""
    peer = request.peer
    resolver = runtime.client_ip
    trusted_peer = resolver.is_trusted(peer)
    # The client IP keys every per-IP limit. resolve() also normalises the peer itself
    # (IPv4-mapped IPv6, zone ids), so it runs for untrusted peers too, headers unread.
    client_ip = resolver.resolve(
        peer, request.headers.getall(resolver.header_name, ()) if trusted_peer else ()
    )
    request.client_ip = client_ip
    return ForwardedFor(
        peer_ip=peer if peer is not None else client_ip,
        client_ip=client_ip,
        proto="https" if request.secure else "http",
        host=host_header,
        trust_incoming=trusted_peer,
    )


async def _read_body_for_keys(
    request: RequestRecord, runtime: Runtime, admitted: _Admitted, facts: RequestFacts
) -> web.Response | None:
    """Read the body for the limits' ``body:FIELD`` key parts (kept on ``admitted``, to forward
    from); the 413 sent, when it is over ``server.body_key_max_size`` and that refuses it."""
    admitted.body, facts.body, too_large = await _body_for_keys(
        request, runtime, admitted.route, admitted.framing
    )
    if too_large and runtime.engine.body_key_rejects:
        refusal = runtime.error_response(
            413,
            "request body larger than the limits read keys from (server.body_key_max_size)",
            close=True,
        )
        return await _answer_and_close(request, refusal)
    return None


def _limits_refusal(runtime: Runtime, outcome: Outcome, framing: RequestFraming) -> web.Response:
    """The answer to a request the limits refused. Marked to close when it has a body: aiohttp
    still reads an unread body for up to its lingering time (so the client sees this answer),
    then closes."""
    engine = runtime.engine
    if outcome.rejected_by is None:  # denied by address or token, store down
        retry = outcome.retry_after_s
        return runtime.error_response(
            outcome.status,
            outcome.reason,
            close=framing.has_body,
            headers={"Retry-After": str(max(1, math.ceil(retry)))}
            if retry
            else _BEARER_CHALLENGE
            if outcome.status == 401
            else None,
        )
    custom = engine.custom_rejection(outcome)
    if custom is not None:
        status, content_type, body = custom  # the policy's rejection
        return custom_rejection_response(
            status, content_type, body, engine.headers(outcome), close=framing.has_body
        )
    return rate_limited_response(
        outcome.status,
        outcome.rejected_by,
        outcome.reason,
        outcome.retry_after_s,
        engine.headers(outcome),
        close=framing.has_body,
    )


def _body_refused(request: RequestRecord, framing: RequestFraming, max_body: int) -> bool:
    """Whether the body is refused before the upstream hears of the request: its length over
    ``max_body``, or a chunk size the connection already refused."""
    if max_body and framing.content_length is not None and framing.content_length > max_body:
        return True
    listener = request.listener
    return listener is not None and listener.body_refused != 0


async def _refuse_body(
    request: RequestRecord, runtime: Runtime, framing: RequestFraming, max_body: int
) -> web.Response:
    """The answer to a body ``_body_refused`` refuses."""
    if max_body and framing.content_length is not None and framing.content_length > max_body:
        return await _refuse(
            request, runtime.error_response(413, "request body too large", close=True), framing
        )
    # A chunk size already refused the body: answer before the upstream hears of it.
    listener = request.listener
    status = listener.body_refused if listener is not None else 400
    message = "request body too large" if status == 413 else "malformed request body"
    return await _answer_and_close(request, runtime.error_response(status, message, close=True))


def _head_builder(
    request: RequestRecord, runtime: Runtime, admitted: _Admitted
) -> Callable[[str], bytes]:
    """The request head for the upstream, given the upstream server's base path."""
    method = request.method
    target = admitted.target
    raw_headers = request.raw_headers
    framing = admitted.framing
    forwarded = admitted.forwarded
    via = runtime.via
    underscores = runtime.underscores_in_headers

    def head_for(base_path: str) -> bytes:
        return build_request_head(
            method,
            base_path + target if base_path else target,
            raw_headers,
            framing,
            forwarded,
            via,
            underscores=underscores,
        )

    return head_for


async def _body_failed(
    request: RequestRecord, runtime: Runtime, failure: Exception
) -> web.Response:
    """The answer when the client's body failed on its way upstream: too large, too slow, or
    broken."""
    if isinstance(failure, BodyTooLarge):
        refusal = runtime.error_response(413, "request body too large", close=True)
        request.local_answer = True
        listener = request.listener
        if listener is not None and listener.body_refused:
            # The rest of an oversized chunk is not worth a lingering read.
            return await _answer_and_close(request, refusal)
        return refusal
    if isinstance(failure, BodyTimeout):
        # The client stopped sending: nothing to linger for.
        return await _answer_and_close(
            request, runtime.error_response(408, "request body timed out", close=True)
        )
    # The upstream connection was cut mid-body, so the upstream never sees it end; the rest
    # of what this client sends is not worth reading.
    return await _answer_and_close(
        request, runtime.error_response(400, "malformed request body", close=True)
    )


def _upstream_failed(
    request: RequestRecord, runtime: Runtime, name: str, error: UpstreamError
) -> web.Response:
    """The answer when no server of the upstream answered (the pool logged each failure)."""
    request.upstream_error = upstream_error_reason(error)
    if isinstance(error, UpstreamConnectError):
        return runtime.error_response(502, f"upstream {name!r}: connection failed")
    if isinstance(error, UpstreamTimeout):
        return runtime.error_response(504, f"upstream {name!r}: timed out")
    return runtime.error_response(502, f"upstream {name!r}: error")


def _read_costs(
    request: RequestRecord, runtime: Runtime, admitted: _Admitted, response: UpstreamResponse
) -> UsageMeter | None:
    """Note what the response's headers say the request cost (for limits charged after the
    response); the meter that reads its body for it (``cost_from``), if any."""
    engine = runtime.engine
    outcome = admitted.outcome
    if outcome is None or not outcome.charge_after:
        return None
    if engine.cost_headers:
        reported = admitted.reported = _reported_costs(response.headers, engine.cost_headers)
        if reported is not None:
            request.reported_costs = {
                name.decode("latin-1"): value.decode("latin-1") for name, value in reported.items()
            }
    if engine.body_costs:
        admitted.meter = usage_meter(engine.body_costs, response.headers)
    return admitted.meter


def _whole_at_once(response: UpstreamResponse, method: str, version: HttpVersion) -> bool:
    """The common case, a small answer already received whole, with a body, to an HTTP/1.1
    request: sent in one write (``_whole_answer``)."""
    return (
        response.body_complete
        and method != "HEAD"
        and response.status not in _NO_BODY_STATUS
        and version == HttpVersion11
    )


def _whole_answer(
    request: RequestRecord,
    runtime: Runtime,
    response: UpstreamResponse,
    meter: UsageMeter | None,
    limit_headers: bytes,
) -> web.StreamResponse:
    """The common case, a small HTTP/1.1 answer already received whole: one write."""
    status = response.status
    whole = response.body_bytes()
    response.release()
    if meter is not None:
        meter.feed(whole)
        meter.finish()
    keep_alive = request.keep_alive
    head = response_head(
        status,
        response.reason,
        response.headers,
        runtime.via,
        runtime.server_line + limit_headers,
        len(whole),
        keep_alive,
        _DATE.now(),
        runtime.hidden_headers,
    )
    return cast(web.StreamResponse, PreparedResponse(status, head + whole, keep_alive))


async def _relayed_answer(
    request: RequestRecord,
    runtime: Runtime,
    admitted: _Admitted,
    response: UpstreamResponse,
    server: PoolMember,
    meter: UsageMeter | None,
    limit_headers: bytes,
) -> web.StreamResponse:
    """The upstream's answer through aiohttp's response objects: whole (HTTP/1.0, no body),
    or streamed as it arrives."""
    status = response.status
    is_head = request.method == "HEAD"
    headers = CIMultiDict(response_headers(response.headers, runtime.via, runtime.hidden_headers))
    if runtime.server_line:  # the upstream's is hidden: the gateway's in its place
        headers["Server"] = SERVER
    outcome = admitted.outcome
    if limit_headers and outcome is not None:
        headers.extend(runtime.engine.headers(outcome))
    reason = response.reason.decode("latin-1")  # "" stays "": aiohttp keeps it
    if response.body_complete and not is_head:
        whole = response.body_bytes()
        response.release()
        if meter is not None:
            meter.feed(whole)
            meter.finish()
        if status in _NO_BODY_STATUS:
            return RelayedResponse(status=status, reason=reason, headers=headers)
        return RelayedResponse(status=status, reason=reason, headers=headers, body=whole)
    stream = RelayedStream(status=status, reason=reason, headers=headers)
    if response.content_length is not None and status not in _NO_BODY_STATUS:
        stream.content_length = response.content_length
    await stream.prepare(request.aiohttp_request())
    admitted.sent_status = status
    if is_head or status in _NO_BODY_STATUS:
        response.release()
        return stream
    if await _relay(request, response, stream, admitted.upstream.pool, server, meter):
        response.release()
    return stream


async def _relay(
    request: RequestRecord,
    response: UpstreamResponse,
    stream: RelayedStream,
    pool: ServerPool,
    server: PoolMember,
    meter: UsageMeter | None,
) -> bool:
    """Stream the rest of the upstream's body to the client; whether it ended whole.

    The headers are sent already, so a failure midway is answered by cutting the client's
    connection short of the framing (fewer bytes than ``Content-Length``, no last chunk): never
    a body that looks complete. Nothing is raised to aiohttp, which would log an ERROR with a
    traceback per request: an upstream's failure (closed, stalled past ``read_timeout``) is
    counted and logged once per cause by the pool's failures; a client that left is no fault.
    With ``meter`` (``cost_from``) the usage is read as it passes, the chunks batched for it.
    """
    read_chunk = response.read_chunk
    write = stream.write
    batch = meter.batch if meter is not None else None
    batched = 0
    try:
        while chunk := await read_chunk():
            if batch is not None and meter is not None:
                batch.append(chunk)
                batched += len(chunk)
                if batched >= BATCH_BYTES:
                    meter.flush()
                    batched = 0
            await write(chunk)
        if meter is not None:
            meter.finish()
        await stream.write_eof()
        return True
    except UpstreamError as exc:
        request.upstream_error = upstream_error_reason(exc)
        pool.failures.record(server.config.url, server.label, exc)
    except ConnectionError:
        pass  # the client went away: nothing left to tell it
    stream.cut(request.transport)
    return False


async def _body_for_keys(
    request: RequestRecord, runtime: Runtime, route: RouteEntry, framing: RequestFraming
) -> tuple[RequestBody | None, object, bool]:
    """A JSON request body read before the limits decide, for their ``body:FIELD`` key parts:
    (the body, to forward from; its document, or None; whether it is over
    ``server.body_key_max_size``). A body that is not JSON, or is encoded, is not read."""
    content_type = request.headers.get("Content-Type", "")
    media = content_type.partition(";")[0].strip().lower()
    if not (media == "application/json" or media.endswith("+json")):
        return None, None, False
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        return None, None, False
    most = runtime.engine.body_key_max_size
    length = framing.content_length
    if length is not None and length > most:
        return None, None, True  # too large, known without reading it
    max_body = route.max_body_size
    if max_body and length is not None and length > max_body:
        return None, None, False  # 413 when it is forwarded
    if framing.expect_continue and request.transport is not None:
        request.transport.write(_CONTINUE)  # the client sends nothing before it
    body = RequestBody(request, max_body, runtime.body_timeout)
    data = await body.read_ahead(most)
    if data is None:
        return body, None, not body.failed
    try:
        document: object = json.loads(data) if data else None
    except ValueError:
        document = None  # not JSON after all: its parts are absent
    return body, document, False


def _shed_response(
    gate: AdaptiveGate, name: str, framing: RequestFraming, runtime: Runtime
) -> web.Response:
    """A request the upstream's adaptive limit has no place for (at once, or within
    ``max_delay``)."""
    return runtime.error_response(
        gate.status,
        f"upstream {name!r} is at its adaptive limit",
        close=framing.has_body,
        headers={"Retry-After": str(max(1, math.ceil(gate.retry_after_s)))},
    )


def _reported_costs(
    raw_headers: Iterable[tuple[bytes, bytes]], names: frozenset[bytes]
) -> dict[bytes, bytes] | None:
    """The first value of each cost header a response holds, by lower-case name."""
    reported: dict[bytes, bytes] | None = None
    for name, value in raw_headers:
        lname = name.lower()
        if lname in names:
            if reported is None:
                reported = {lname: value}
            elif lname not in reported:
                reported[lname] = value
    return reported


async def _refuse(
    request: RequestRecord, response: web.Response, framing: RequestFraming
) -> web.Response:
    """Answer before the body is read. A client waiting for ``100 Continue`` will send no body,
    so the connection is closed right after the answer instead of lingering for one."""
    request.local_answer = True
    if framing.expect_continue:
        return await _answer_and_close(request, response)
    return response


async def _answer_and_close(request: RequestRecord, response: web.Response) -> web.Response:
    """Send ``response`` and close at once, skipping aiohttp's lingering read of the body."""
    request.local_answer = True
    if request.transport is not None:
        await response.prepare(request.aiohttp_request())
        await response.write_eof()
        request.transport.close()
    return response


def _answer_raw_and_close(request: RequestRecord, data: bytes) -> web.StreamResponse:
    """Write a whole response the gateway serialised (in HTTP/1.1 whatever the request's
    version) and close the connection."""
    transport = request.transport
    if transport is not None and not transport.is_closing():
        transport.write(data)
        transport.close()
    return cast(web.StreamResponse, PreparedResponse(505, b"", False))


class RequestBody:
    """The client's request body as it arrives, for the upstream client to send on: each read
    under the body timeout, the total under ``max_body``. (An async iterator class: mypyc
    compiles no async generator.) What ``read_ahead`` read for the limits' keys comes first,
    then the rest, so the body goes on unchanged."""

    __slots__ = ("_content", "_error", "_max_body", "_read", "_received", "_timeout")

    def __init__(self, request: RequestRecord, max_body: int, body_timeout: float) -> None:
        self._content = request.content
        self._max_body = max_body
        self._timeout = body_timeout or None
        self._received = 0
        # Chunks read ahead (``read_ahead``), and the error that ended that reading, if one
        # did: given to the upstream client in order, the error when it reaches it.
        self._read: list[bytes] = []
        self._error: Exception | None = None

    def __aiter__(self) -> RequestBody:
        return self

    @property
    def failed(self) -> bool:
        """Whether reading ahead ended in an error (sent on when the body is)."""
        return self._error is not None

    async def read_ahead(self, most: int) -> bytes | None:
        """The body, read ahead of forwarding, when it is at most ``most`` bytes; None when
        it is longer (or fails: the error comes when the body is sent on)."""
        read = self._read
        size = 0
        while size <= most:
            try:
                chunk = await self._next_chunk()
            except StopAsyncIteration:
                return b"".join(read)
            except (BodyTooLarge, BodyTimeout, BodyBroken) as exc:
                self._error = exc
                return None
            read.append(chunk)
            size += len(chunk)
        return None

    async def __anext__(self) -> bytes:
        read = self._read
        if read:
            return read.pop(0)
        error = self._error
        if error is not None:
            self._error = None
            raise error
        return await self._next_chunk()

    async def _next_chunk(self) -> bytes:
        try:
            # The deadline is for each read: a slow but steady upload is fine.
            async with asyncio.timeout(self._timeout):
                chunk = await self._content.readany()
        except ChunkTooLarge:
            raise BodyTooLarge from None
        except RequestPayloadError as exc:
            raise BodyBroken(str(exc)) from None
        except TimeoutError:
            raise BodyTimeout from None
        if not chunk:
            raise StopAsyncIteration
        self._received += len(chunk)
        if self._max_body and self._received > self._max_body:
            raise BodyTooLarge
        return chunk
