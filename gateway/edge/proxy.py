"""The request handler: check, route, resolve the client, forward, stream the answer back."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import TYPE_CHECKING, cast

from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDict

from gateway.edge.adaptive_gate import AdaptiveGate
from gateway.edge.aiohttp_private import RelayedResponse, RelayedStream, request_message
from gateway.edge.annotations import (
    CLIENT_IP,
    LOCAL_ANSWER,
    REPORTED_COSTS,
    ROUTE_NAME,
    UPSTREAM_ERROR,
    upstream_error_reason,
)
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
from gateway.edge.responses import (
    HttpDate,
    PreparedResponse,
    error_response,
    rate_limited_response,
    version_not_supported,
)
from gateway.edge.server import ChunkTooLarge, GatewayProtocol
from gateway.edge.upstream_client import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.edge.websocket import forward_upgrade, wants_upgrade
from gateway.engine.delay_queue import ShuttingDown
from gateway.limits.keys import RequestFacts
from gateway.limits.routing import RefusedTarget, normalise_host, origin_form, routing_path

if TYPE_CHECKING:
    from gateway.edge.runtime import Runtime, UpstreamTarget
    from gateway.engine.limit_engine import Outcome
    from gateway.policy.models import Route

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

    __slots__ = ("forwarded", "framing", "outcome", "reported", "route", "target", "upstream")

    def __init__(
        self,
        route: Route,
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
        # Told about every finished request (status, seconds, the limits' outcome if they
        # decided it): the metrics and access log. The outcome is handed over here rather
        # than left in the request's mapping: compiled, that mapping's methods are aiohttp's
        # interpreted ones (bench/README.md, third round).
        self.observer: Callable[[BaseRequest, int, float, Outcome | None], None] | None = None

    async def __call__(self, request: BaseRequest) -> web.StreamResponse:
        started = perf_counter()
        protocol = request.protocol
        if isinstance(protocol, GatewayProtocol):
            protocol.request_started(request.content)
        runtime = self.runtime
        runtime.inflight += 1
        status = 500
        admitted: web.StreamResponse | _Admitted | _Refused | None = None
        response: web.StreamResponse
        try:
            # Admit, wait, forward: a request in the shaping queue holds this one coroutine of
            # ours and what ``_admit`` kept for forwarding, not the frames that decided it
            # (each some 300-500 bytes, and 10,000 may wait at once).
            admitted = await self._admit(request, runtime)
            if isinstance(admitted, _Refused):
                response = await _refuse(request, admitted.response, admitted.framing)
            elif not isinstance(admitted, _Admitted):
                response = admitted
            else:
                outcome = admitted.outcome
                if outcome is not None and outcome.delay_s > 0.0:
                    engine = runtime.engine
                    try:
                        await engine.enter_queue(outcome)
                    except (asyncio.CancelledError, ShuttingDown):
                        await engine.give_back(outcome)
                        outcome.charge_after = ()  # it never reached the upstream
                        raise
                    finally:
                        engine.leave_queue(outcome)
                if request_message(request).upgrade and wants_upgrade(
                    request, admitted.framing, runtime
                ):
                    response = await forward_upgrade(
                        request,
                        runtime,
                        admitted.upstream,
                        admitted.target,
                        admitted.framing,
                        admitted.forwarded,
                        outcome,
                    )
                else:
                    response = await self._forward(request, runtime, admitted)
            status = response.status
            return response
        except ShuttingDown:
            status = 503
            request[LOCAL_ANSWER] = True
            return error_response(
                503, "the gateway is shutting down", close=True, headers={"Retry-After": "1"}
            )
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            outcome = None
            if isinstance(admitted, _Admitted):
                outcome = admitted.outcome
                if outcome is not None:
                    if outcome.held:
                        # Its concurrency slots: the response is sent (the body handed to the
                        # connection), the client went away, the upstream failed or a
                        # WebSocket closed.
                        runtime.engine.release(outcome)
                    if outcome.charge_after:
                        # The status the client got (499 if it left), and what the upstream
                        # said the request cost: never awaited by the response.
                        runtime.engine.charge_after(outcome, status, admitted.reported)
            elif isinstance(admitted, _Refused):
                outcome = admitted.outcome
            runtime.request_done()
            if isinstance(protocol, GatewayProtocol):
                protocol.request_finished()
            observer = self.observer
            if observer is not None:
                observer(request, status, perf_counter() - started, outcome)

    async def _admit(
        self, request: BaseRequest, runtime: Runtime
    ) -> web.StreamResponse | _Admitted | _Refused:
        """Check the request, route it, resolve the client and ask the limits: a response that
        ends the request here, the limits' refusal, or what forwarding it needs (after its
        delay, if any)."""
        version = request.version
        if version != HttpVersion11 and version != HttpVersion10:
            # llhttp also parses 0.9 and 2.0 request lines; aiohttp would answer in that version.
            return _answer_raw_and_close(request, version_not_supported())
        try:
            framing = check_request(request.raw_headers, version)
        except BadFraming as bad_framing:
            # Where this body ends is unknown: reading on for aiohttp's lingering close would
            # hold the connection for up to 10 s to no purpose.
            return await _answer_and_close(
                request, error_response(bad_framing.status, bad_framing.reason, close=True)
            )
        except BadRequest as bad_request:
            return error_response(bad_request.status, bad_request.reason, close=True)
        method = request.method
        if method == "CONNECT":
            return error_response(405, "CONNECT is not supported", close=True)
        host_header = request.headers.get("Host")
        try:
            target = origin_form(request.raw_path, method, host_header)
        except RefusedTarget as refused:
            return error_response(400, str(refused), close=True)

        host = normalise_host(host_header)
        path = routing_path(target)
        route = runtime.routes.match(host, path, method)
        if route is None:
            return error_response(404, "no route matches this request")
        request[ROUTE_NAME] = route.name
        upstream = runtime.upstreams[route.upstream]

        # aiohttp's cached copy: the transport would make a syscall and a new tuple per call.
        peername = request.protocol.peername
        peer: str | None = peername[0] if peername else None
        resolver = runtime.client_ip
        trusted_peer = resolver.is_trusted(peer)
        # The client IP keys every per-IP limit. resolve() also normalises the peer itself
        # (IPv4-mapped IPv6, zone ids), so it runs for untrusted peers too, headers unread.
        client_ip = resolver.resolve(
            peer, request.headers.getall(resolver.header_name, ()) if trusted_peer else ()
        )
        request[CLIENT_IP] = client_ip

        outcome: Outcome | None = None
        engine = runtime.engine
        if engine.active:
            facts = RequestFacts.of(
                client_ip,
                engine.ipv6_prefix,
                route.name,
                method,
                request.headers,
                lambda: request.query,
            )
            if engine.identity is not None and engine.keys_pending(facts):
                await engine.await_keys(facts)  # a new kid: the key set fetched, bounded
            if engine.decides_now:
                outcome = engine.evaluate_now(facts, route, host, path, client_ip)
            else:
                outcome = await engine.evaluate(facts, route, host, path, client_ip)
            if outcome.waits_on is not None:  # over a concurrency limit: in line for a slot
                outcome = await engine.wait_for_slot(outcome)
            if outcome.status:
                # Marked to close: aiohttp still reads an unread body for up to its
                # lingering time (so the client sees this answer), then closes.
                if outcome.rejected_by is None:  # denied by address or token, store down
                    retry = outcome.retry_after_s
                    refusal = error_response(
                        outcome.status,
                        outcome.reason,
                        close=framing.has_body,
                        headers={"Retry-After": str(max(1, math.ceil(retry)))}
                        if retry
                        else _BEARER_CHALLENGE
                        if outcome.status == 401
                        else None,
                    )
                elif (custom := engine.custom_rejection(outcome)) is not None:
                    status, content_type, body = custom  # the policy's rejection:
                    refusal = custom_rejection_response(
                        status, content_type, body, engine.headers(outcome), close=framing.has_body
                    )
                else:
                    refusal = rate_limited_response(
                        outcome.status,
                        outcome.rejected_by,
                        outcome.reason,
                        outcome.retry_after_s,
                        engine.headers(outcome),
                        close=framing.has_body,
                    )
                return _Refused(refusal, outcome, framing)

        return _Admitted(
            route,
            upstream,
            target,
            framing,
            ForwardedFor(
                peer_ip=peer if peer is not None else client_ip,
                client_ip=client_ip,
                proto="https" if request.secure else "http",
                host=host_header,
                trust_incoming=trusted_peer,
            ),
            outcome,
        )

    async def _forward(
        self, request: BaseRequest, runtime: Runtime, admitted: _Admitted
    ) -> web.StreamResponse:
        framing = admitted.framing
        outcome = admitted.outcome
        limit_headers = (
            runtime.engine.header_block(outcome)
            if outcome is not None and outcome.verdict is not None
            else b""
        )
        route = admitted.route
        max_body = route.max_body_size
        if max_body is None:
            max_body = runtime.settings.max_body_size
        if max_body and framing.content_length is not None and framing.content_length > max_body:
            return await _refuse(
                request, error_response(413, "request body too large", close=True), framing
            )

        protocol = request.protocol
        if isinstance(protocol, GatewayProtocol) and protocol.body_refused:
            # A chunk size already refused the body: answer before the upstream hears of it.
            status = protocol.body_refused
            message = "request body too large" if status == 413 else "malformed request body"
            return await _answer_and_close(request, error_response(status, message, close=True))

        upstream = admitted.upstream
        # The upstream's adaptive limit (this worker's): a place before the request goes out,
        # given back once its response is in; beyond it, a wait or the answer at once.
        gate = upstream.gate
        started_us = 0
        if gate is not None:
            if not gate.try_enter() and not await gate.enter():
                request[LOCAL_ANSWER] = True
                return await _refuse(request, _shed_response(gate, upstream.name, framing), framing)
            started_us = gate.now_us()

        if framing.expect_continue and request.transport is not None:
            request.transport.write(_CONTINUE)

        pool = upstream.pool
        target = admitted.target
        via = runtime.via
        method = request.method
        raw_headers = request.raw_headers
        forwarded = admitted.forwarded
        underscores = runtime.settings.underscores_in_headers

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

        body_timeout = runtime.settings.body_timeout
        chunked = framing.chunked
        is_head = method == "HEAD"
        measured = False  # the response (or a timeout) tells the adaptive limit a latency
        try:
            body: RequestBody | bytes | None = None
            if framing.has_body:
                body = RequestBody(request, max_body, body_timeout)
                if should_buffer(pool, method, framing.content_length):
                    body = await read_whole(body)
            response, server = await send(
                pool,
                method,
                head_for,
                body,
                body_chunked=chunked,
                expect_no_body=is_head,
                key=hash_key(
                    request, pool, route.name, forwarded.client_ip, runtime.engine.ipv6_prefix
                ),
                connect_timeout_s=route.connect_timeout or 0.0,
                read_timeout_s=route.read_timeout or 0.0,
            )
            measured = True
        except BodyTooLarge:
            refusal = error_response(413, "request body too large", close=True)
            request[LOCAL_ANSWER] = True
            if isinstance(protocol, GatewayProtocol) and protocol.body_refused:
                # The rest of an oversized chunk is not worth a lingering read.
                return await _answer_and_close(request, refusal)
            return refusal
        except BodyTimeout:
            # The client stopped sending: nothing to linger for.
            return await _answer_and_close(
                request, error_response(408, "request body timed out", close=True)
            )
        except BodyBroken:
            # The upstream connection was cut mid-body, so the upstream never sees it end;
            # the rest of what this client sends is not worth reading.
            return await _answer_and_close(
                request, error_response(400, "malformed request body", close=True)
            )
        # One name per handler: compiled, a name bound by several ``except`` clauses takes the
        # first clause's type (tests/test_build.py checks every compiled module for it).
        except UpstreamConnectError as connect_error:  # the pool logged each server's failure
            request[UPSTREAM_ERROR] = upstream_error_reason(connect_error)
            return error_response(502, f"upstream {upstream.name!r}: connection failed")
        except UpstreamTimeout as timeout:
            measured = True
            request[UPSTREAM_ERROR] = upstream_error_reason(timeout)
            return error_response(504, f"upstream {upstream.name!r}: timed out")
        except UpstreamError as upstream_error:
            request[UPSTREAM_ERROR] = upstream_error_reason(upstream_error)
            return error_response(502, f"upstream {upstream.name!r}: error")
        finally:
            if gate is not None:  # whatever ended it, the client gone too
                gate.release(started_us, measured=measured)

        engine = runtime.engine
        hidden = engine.hidden_headers
        if engine.cost_headers and outcome is not None and outcome.charge_after:
            reported = admitted.reported = _reported_costs(response.headers, engine.cost_headers)
            if reported is not None:
                request[REPORTED_COSTS] = {
                    name.decode("latin-1"): value.decode("latin-1")
                    for name, value in reported.items()
                }
        try:
            status = response.status
            if (
                response.body_complete
                and not is_head
                and status not in _NO_BODY_STATUS
                and request.version == HttpVersion11
            ):
                # The common case, a small answer already received whole: one write.
                whole = response.body_bytes()
                response.release()
                keep_alive = request.keep_alive
                head = response_head(
                    status,
                    response.reason,
                    response.headers,
                    via,
                    limit_headers,
                    len(whole),
                    keep_alive,
                    _DATE.now(),
                    hidden,
                )
                return cast(web.StreamResponse, PreparedResponse(status, head + whole, keep_alive))
            headers = CIMultiDict(response_headers(response.headers, via, hidden))
            if limit_headers and outcome is not None:
                headers.extend(runtime.engine.headers(outcome))
            reason = response.reason.decode("latin-1")  # "" stays "": aiohttp keeps it
            if response.body_complete and not is_head:
                whole = response.body_bytes()
                response.release()
                if status in _NO_BODY_STATUS:
                    return RelayedResponse(status=status, reason=reason, headers=headers)
                return RelayedResponse(status=status, reason=reason, headers=headers, body=whole)
            stream = RelayedStream(status=status, reason=reason, headers=headers)
            if response.content_length is not None and status not in _NO_BODY_STATUS:
                stream.content_length = response.content_length
            await stream.prepare(request)
            if is_head or status in _NO_BODY_STATUS:
                response.release()
                return stream
            read_chunk = response.read_chunk
            write = stream.write
            try:
                while chunk := await read_chunk():
                    await write(chunk)
            except UpstreamError as exc:
                request[UPSTREAM_ERROR] = upstream_error_reason(exc)
                pool.failures.record(server.config.url, server.label, exc)
                # Headers are gone already: the only honest signal left is to cut the
                # connection, so the client sees a truncated body rather than a short one.
                if request.transport is not None:
                    request.transport.close()
                raise ConnectionResetError("upstream body truncated") from None
            await stream.write_eof()
            response.release()
            return stream
        finally:
            response.close()
            pool.finished(server)


def _shed_response(gate: AdaptiveGate, name: str, framing: RequestFraming) -> web.Response:
    """A request the upstream's adaptive limit has no place for (at once, or within
    ``max_delay``)."""
    return error_response(
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
    request: BaseRequest, response: web.Response, framing: RequestFraming
) -> web.Response:
    """Answer before the body is read. A client waiting for ``100 Continue`` will send no body,
    so the connection is closed right after the answer instead of lingering for one."""
    request[LOCAL_ANSWER] = True
    if framing.expect_continue:
        return await _answer_and_close(request, response)
    return response


async def _answer_and_close(request: BaseRequest, response: web.Response) -> web.Response:
    """Send ``response`` and close at once, skipping aiohttp's lingering read of the body."""
    request[LOCAL_ANSWER] = True
    if request.transport is not None:
        await response.prepare(request)
        await response.write_eof()
        request.transport.close()
    return response


def _answer_raw_and_close(request: BaseRequest, data: bytes) -> web.StreamResponse:
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
    compiles no async generator.)"""

    __slots__ = ("_content", "_max_body", "_received", "_timeout")

    def __init__(self, request: BaseRequest, max_body: int, body_timeout: float) -> None:
        self._content = request.content
        self._max_body = max_body
        self._timeout = body_timeout or None
        self._received = 0

    def __aiter__(self) -> RequestBody:
        return self

    async def __anext__(self) -> bytes:
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
