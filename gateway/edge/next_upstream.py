"""Sending a request to its upstream's pool, and on to the next server when one fails (nginx's
``proxy_next_upstream``).

The rule for sending a request again: after a failed connect nothing of it went out, so any
request may go to the next server (its body, not yet read, goes with it); once it went out, only
an idempotent method (RFC 9110 9.2.2) whose body is held whole in memory (none, or one of at
most ``retry.buffer_body`` bytes read before sending) may, since the server may have acted on
it. A POST or PATCH is never sent twice. Every attempt stays inside the one admission the
request got from the limits: to the client it is one request.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Final

from gateway.edge.annotations import upstream_error_reason
from gateway.edge.pool.server_pool import PoolMember, ServerPool
from gateway.edge.request_record import RequestRecord
from gateway.edge.upstream_client import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.limits.addresses import client_key
from gateway.limits.keys import RequestFacts

IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


def hash_key(
    request: RequestRecord, pool: ServerPool, route: str, client_ip: str, ipv6_prefix: int
) -> str:
    """The request's key for ``balance: hash`` (empty for the other balancers)."""
    builder = pool.key_builder
    if builder is None:
        return ""
    facts = RequestFacts(
        client_key(client_ip, ipv6_prefix),
        route,
        request.method,
        request.headers,
        request.query,
    )
    return builder.build(facts) or ""


def may_send_again(went_out: bool, idempotent: bool, body_in_memory: bool) -> bool:
    """The retry rule above, in one place."""
    return not went_out or (idempotent and body_in_memory)


def should_buffer(pool: ServerPool, method: str, content_length: int | None) -> bool:
    """Read this request's body whole before sending it, so another server can be sent it too."""
    limit = pool.retry.buffer_body
    return (
        content_length is not None
        and 0 < content_length <= limit
        and method in IDEMPOTENT_METHODS
        and pool.tries > 1
        and bool(pool.retry.when)
    )


async def read_whole(body: AsyncIterator[bytes]) -> bytes:
    chunks = [chunk async for chunk in body]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send(
    pool: ServerPool,
    method: str,
    head_for: Callable[[str], bytes],
    body: AsyncIterable[bytes] | bytes | None,
    *,
    body_chunked: bool,
    expect_no_body: bool,
    key: str,
    connect_timeout_s: float,
    read_timeout_s: float,
) -> tuple[UpstreamResponse, PoolMember]:
    """The response of the first server that answered for good, and that server (hand it to
    ``pool.finished`` when the response is done with). The last attempt's error propagates if no
    server answered; errors of a streamed ``body`` propagate unchanged.

    ``head_for(base_path)`` is the request head for a server whose URL carries ``base_path``.
    """
    retry = pool.retry
    retry_on = retry.when
    tries = pool.tries
    idempotent = method in IDEMPOTENT_METHODS
    in_memory = body is None or isinstance(body, bytes)
    tried: list[PoolMember] = []
    deadline = 0.0
    head = b""
    head_path: str | None = None
    while True:
        member = pool.pick(tried, key)
        if member is None:
            raise UpstreamConnectError("no server left to try")  # unreachable: checked below
        tried.append(member)
        if member.base_path != head_path:
            head_path = member.base_path
            head = head_for(head_path)
        started_at = pool.started(member)
        if not deadline and retry.retry_timeout:
            deadline = started_at + retry.retry_timeout
        try:
            response = await member.connections.request(
                head,
                body,
                body_chunked=body_chunked,
                expect_no_body=expect_no_body,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
            )
        except UpstreamError as exc:
            pool.finished(member)
            reason = upstream_error_reason(exc)
            pool.failed(member, reason, exc)
            went_out = not isinstance(exc, UpstreamConnectError | UpstreamConnectTimeout)
            cause = "timeout" if isinstance(exc, UpstreamTimeout) else "error"
            if (
                cause in retry_on
                and may_send_again(went_out, idempotent, in_memory)
                and _more(pool, tried, tries, deadline)
            ):
                pool.retried(reason)
                continue
            raise
        except BaseException:
            pool.unanswered(member)
            pool.finished(member)
            raise
        status = response.status
        pool.answered(member, status, started_at)
        if (
            status in retry_on
            and may_send_again(True, idempotent, in_memory)
            and _more(pool, tried, tries, deadline)
        ):
            _discard(response)
            pool.finished(member)
            pool.retried("status")
            continue
        return response, member


def _more(pool: ServerPool, tried: list[PoolMember], tries: int, deadline: float) -> bool:
    if len(tried) >= tries or len(tried) >= len(pool.members):
        return False
    return not deadline or pool.now() < deadline


def _discard(response: UpstreamResponse) -> None:
    """Done with a response that is not relayed: keep its connection if it came whole."""
    if response.body_complete:
        response.body_bytes()
        response.release()
    else:
        response.close()
