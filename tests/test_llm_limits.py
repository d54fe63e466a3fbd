"""Token budgets for LLM APIs (``cost_from:``, ``reserve:``): the official ``openai`` client
through a real gateway to a test upstream speaking the OpenAI-compatible API, in process, in
the workers' shared store and in real Redis. A call is charged the usage its answer reports;
with ``reserve`` each call in flight holds that estimate, settled to the usage."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.clock import FakeClock
from gateway.engine.preflight import parse_and_build
from gateway.replay import replay
from gateway.replay.simulate import Simulation
from tests.support import redis_harness
from tests.support.conformance import T0_US, gateway_store_of
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.llm_upstream import LlmUpstream
from tests.support.metrics import scrape_until, value
from tests.support.processes import GatewayProcess, StartGateway
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
TIMEOUT = aiohttp.ClientTimeout(total=30)


def _policy(upstream: LlmUpstream, limit: str) -> str:
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  llm:\n    url: {upstream.url}\n    read_timeout: 30s\n"
        "    max_connections: 512\n"
        "routes:\n  - name: llm\n    match: {path_prefix: /v1/}\n    upstream: llm\n"
        "limits:\n" + limit
    )


def _tokens(limit: int, extra: str = "") -> str:
    return (
        "  tokens:\n    algorithm: fixed_window\n"
        f"    limit: {limit}\n    window: 1h\n    key: ['header:Authorization']\n"
        "    cost_from: openai\n" + extra
    )


def _client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)


async def _call(
    client: openai.AsyncOpenAI, words: int, max_tokens: int, model: str = "test-model", **extra: Any
) -> Any:
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": " ".join(["hello"] * words)}],
        max_tokens=max_tokens,
        **extra,
    )


async def _stream(
    client: openai.AsyncOpenAI, words: int, max_tokens: int, model: str = "test-model"
) -> Any:
    """A streamed call, read to its end: the usage its last event reported."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": " ".join(["hello"] * words)}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
    return usage


async def _call_either(client: openai.AsyncOpenAI, words: int, max_tokens: int, draw: float) -> Any:
    if draw < 0.5:
        return await _stream(client, words, max_tokens)
    return (await _call(client, words, max_tokens)).usage


async def _left(gw: RunningGateway | GatewayProcess) -> int:
    """What the key has left (/explain: the next call's remaining plus its own hold)."""
    params = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "header": "Authorization:Bearer sk-test",
    }
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/explain", params=params) as resp,
    ):
        explained = await resp.json()
    (entry,) = [limit for limit in explained["limits"] if limit["name"] == "tokens"]
    decision = entry["next_request"]
    return int(decision["remaining"]) + (entry["cost"] if decision["allowed"] else 0)


async def _settled(gw: RunningGateway) -> None:
    await gw.gateway.handler.runtime.engine.charges_done()


CALLS = 1000
BUDGET = 10_000_000


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "reserve"),
    [
        ("memory", ""),
        ("memory", "    reserve: 64\n"),
        ("shared", "    reserve: 64\n"),
        ("redis", ""),
        ("redis", "    reserve: 64\n"),
        ("cluster", "    reserve: 64\n"),
    ],
    ids=["memory", "memory-reserve", "shared-reserve", "redis", "redis-reserve", "cluster-reserve"],
)
async def test_each_call_is_charged_the_usage_its_answer_reports(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
    reserve: str,
) -> None:
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(llm_upstream, _tokens(BUDGET, reserve)),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "llm"),
    )
    rng = random.Random(7)
    client = _client(gw)
    try:
        for _ in range(CALLS // 20):
            # Half streamed (the usage in the last event, as asked), half not.
            usages = await asyncio.gather(
                *[
                    _call_either(client, rng.randint(1, 40), rng.randint(1, 120), rng.random())
                    for _ in range(20)
                ]
            )
            assert all(usage is not None for usage in usages)
    finally:
        await client.close()
    await _settled(gw)
    used = sum(llm_upstream.reported)
    assert len(llm_upstream.reported) == CALLS
    (limit,) = gw.gateway.handler.runtime.engine.limits
    assert limit.counters.charged_units == used
    assert limit.counters.charged_responses == CALLS
    assert await _left(gw) == BUDGET - used


@pytest.mark.parametrize(
    ("usage", "reserve", "charged"),
    [("missing", 64, 64), ("malformed", 64, 64), ("missing", None, 1), ("malformed", None, 1)],
)
async def test_an_answer_without_a_usable_usage_is_charged_the_fallback_and_logged_once(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    usage: str,
    reserve: int | None,
    charged: int,
) -> None:
    extra = f"    reserve: {reserve}\n" if reserve is not None else ""
    gw = await start_gateway(_policy(llm_upstream, _tokens(1000, extra)), clock=FakeClock(T0_US))
    client = _client(gw)
    caplog.set_level(logging.WARNING, "gateway.limits")
    try:
        for _ in range(3):
            await _call(client, 5, 10, extra_body={"usage": usage})
    finally:
        await client.close()
    await _settled(gw)
    assert await _left(gw) == 1000 - 3 * charged
    lines = [r.getMessage() for r in caplog.records if "no usable usage" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "cost_from 'openai'" in lines[0] and "route 'llm'" in lines[0]


async def _concurrent_calls(
    gw: RunningGateway,
    upstream: LlmUpstream,
    n: int,
    while_held: Callable[[], Awaitable[None]] | None = None,
) -> list[int]:
    """``n`` calls at once (10 prompt words, 200 completion tokens: 210 each), the upstream
    holding its answers until every call has reached it or been refused (and ``while_held``
    has looked): the statuses."""
    upstream.hold = asyncio.Event()
    client = _client(gw)

    async def one() -> int:
        try:
            await _call(client, 10, 200)
        except openai.RateLimitError:
            return 429
        return 200

    try:
        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await wait_until(
            lambda: upstream.in_flight + sum(t.done() for t in tasks) == n, "calls in or refused"
        )
        if while_held is not None:
            await while_held()
        upstream.hold.set()
        statuses = await asyncio.gather(*tasks)
    finally:
        await client.close()
    await _settled(gw)
    return statuses


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_reservation_bounds_what_calls_in_flight_can_spend(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """1,000 tokens, 10 calls at once using 210 each. Reserving 300: 3 are in flight at
    once (900 held), the rest refused; they spend 630, within the budget. Reserving each
    call's max_tokens (200, read from its body) in 1,100: 5 go, spending 1,050. Without a
    reservation each holds 1 unit: all 10 go, spending 2,100, and the charges stop at the
    budget (the overshoot the docs bound: calls in flight times their usage beyond the hold)."""
    clock = FakeClock(T0_US)
    store = gateway_store_of(kind, request, clock, tmp_path, "llm")
    gw = await start_gateway(
        _policy(llm_upstream, _tokens(1000, "    reserve: 300\n")), clock=clock, **store
    )
    (limit,) = gw.gateway.handler.runtime.engine.limits

    async def held_now() -> None:
        """The 3 calls in flight hold 900 tokens: so says the gauge, until they settle."""
        assert limit.counters.units_in_flight == 900
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await scrape_until(
                session,
                gw.admin_url,
                lambda got: value(got, "gateway_limit_units_in_flight", limit="tokens") == 900,
            )

    statuses = await _concurrent_calls(gw, llm_upstream, 10, held_now)
    assert limit.counters.units_in_flight == 0
    assert sorted(statuses) == [200] * 3 + [429] * 7
    assert sum(llm_upstream.reported) == 630
    assert await _left(gw) == 370
    counters = limit.counters
    assert (counters.held_units, counters.returned_units, counters.charged_units) == (900, 270, 630)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda got: (
                value(got, "gateway_limit_returned_units_total", limit="tokens", model="test-model")
                == 270
            ),
        )
    assert (
        value(samples, "gateway_limit_held_units_total", limit="tokens", model="test-model") == 900
    )
    assert value(samples, "gateway_limit_units_in_flight", limit="tokens") == 0
    clock.advance(3600)

    # Reserving what each call asks for (its max_tokens, 200): 5 of the 10 fit in 1,100.
    llm_upstream.reported.clear()
    from_body = "    reserve: {body: [max_completion_tokens, max_tokens], default: 1000}\n"
    gw = await start_gateway(
        _policy(llm_upstream, _tokens(1100, from_body)),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "llm"),
    )
    statuses = await _concurrent_calls(gw, llm_upstream, 10)
    assert sorted(statuses) == [200] * 5 + [429] * 5
    assert sum(llm_upstream.reported) == 1050
    assert await _left(gw) == 50
    clock.advance(3600)

    llm_upstream.reported.clear()
    gw = await start_gateway(
        _policy(llm_upstream, _tokens(1000)),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "llm"),
    )
    statuses = await _concurrent_calls(gw, llm_upstream, 10)
    assert statuses == [200] * 10
    assert sum(llm_upstream.reported) == 2100  # 1,100 over the budget
    assert await _left(gw) == 0


async def _gone_mid_stream(gw: RunningGateway, upstream: LlmUpstream, body: dict[str, Any]) -> None:
    """A streamed call whose client reads its first events and leaves while the upstream
    is in the middle of the answer."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        resp = await session.post(
            gw.url + body.pop("path"), json=body, headers={"Authorization": "Bearer sk-test"}
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        await wait_until(lambda: upstream.stalled == 1, "the stream stalled upstream")
        resp.close()
    runtime = gw.gateway.handler.runtime
    await wait_until(lambda: runtime.inflight == 0, "the gateway to see the client gone")
    await _settled(gw)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_client_gone_mid_stream_is_charged_its_reservation_or_the_usage_so_far(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """A call cut short is charged at least its reservation, or the usage reported so far
    if that is more. OpenAI's stream says its usage at its end only: a client gone before it
    is charged the reservation (64). Anthropic's says the input first: 50 words in and 1 out
    so far is less than its reservation (80), which is charged; 100 in and 1 out is more."""
    clock = FakeClock(T0_US)
    limits = _tokens(1000, "    reserve: 64\n") + (
        "  anthropic_tokens:\n    algorithm: fixed_window\n    limit: 1000\n    window: 1h\n"
        "    key: ['header:Authorization']\n    match: {path: /v1/messages}\n"
        "    cost_from: anthropic\n    reserve: 80\n"
    )
    limits = limits.replace(
        "    cost_from: openai\n",
        "    cost_from: openai\n    match: {path: /v1/chat/completions}\n",
        1,
    )
    gw = await start_gateway(
        _policy(llm_upstream, limits),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "llm"),
    )
    engine = gw.gateway.handler.runtime.engine
    tokens, anthropic_tokens = engine.limits
    await _gone_mid_stream(
        gw,
        llm_upstream,
        {
            "path": "/v1/chat/completions",
            "model": "m",
            "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": 100,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stall": True,
        },
    )
    assert tokens.counters.charged_units == 64
    for words in (50, 100):
        llm_upstream.stalled = 0
        await _gone_mid_stream(
            gw,
            llm_upstream,
            {
                "path": "/v1/messages",
                "model": "m",
                "messages": [{"role": "user", "content": "hello " * words}],
                "max_tokens": 100,
                "stream": True,
                "stall": True,
            },
        )
    assert anthropic_tokens.counters.charged_units == 80 + 101
    assert tokens.counters.charged_units == 64


async def test_a_stream_that_ends_without_usage_is_charged_the_reservation_and_logged(
    llm_upstream: LlmUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An OpenAI stream not asked for its usage (no ``stream_options.include_usage``)."""
    gw = await start_gateway(
        _policy(llm_upstream, _tokens(1000, "    reserve: 64\n")), clock=FakeClock(T0_US)
    )
    caplog.set_level(logging.WARNING, "gateway.limits")
    client = _client(gw)
    try:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        assert len([chunk async for chunk in stream]) == 6
    finally:
        await client.close()
    await _settled(gw)
    assert await _left(gw) == 1000 - 64
    (line,) = [r.getMessage() for r in caplog.records if "no usable usage" in r.getMessage()]
    assert "stream_options.include_usage" in line


def _body_keyed(upstream_url: str, server: str = "") -> str:
    """Two calls an hour per API key and model, the model read from the request body."""
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        + server
        + f"upstreams:\n  llm:\n    url: {upstream_url}\n"
        "routes:\n  - name: llm\n    upstream: llm\n"
        "limits:\n  per_model:\n    algorithm: fixed_window\n    limit: 2\n    window: 1h\n"
        "    key: ['header:Authorization', 'body:model']\n"
    )


async def test_a_key_part_from_the_request_body(
    llm_upstream: LlmUpstream, start_gateway: GatewayFactory
) -> None:
    """Two calls per model: the third for one model is refused before the upstream, another
    model still has its own two."""
    gw = await start_gateway(_body_keyed(llm_upstream.url), clock=FakeClock(T0_US))
    client = _client(gw)
    try:
        for _ in range(2):
            await _call(client, 3, 4)
        with pytest.raises(openai.RateLimitError):
            await _call(client, 3, 4)
        answer = await client.chat.completions.create(
            model="other-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert answer.model == "other-model"
    finally:
        await client.close()
    assert llm_upstream.calls == 3


def _chunked(data: bytes) -> Any:
    async def chunks() -> Any:
        for start in range(0, len(data), 7):
            yield data[start : start + 7]

    return chunks()


@pytest.mark.parametrize("too_large", ["reject", "absent"])
async def test_a_body_read_for_keys_is_forwarded_unchanged_and_bounded(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, too_large: str
) -> None:
    """Bodies within ``body_key_max_size`` (256 bytes here), with a length or chunked, reach
    the upstream byte for byte and are keyed by their model; a larger one is refused (413)
    or forwarded whole with its body part absent (the limit skipped), as the policy says."""
    server = f"  body_key_max_size: 256\n  body_key_too_large: {too_large}\n"
    gw = await start_gateway(_body_keyed(upstream.url, server), clock=FakeClock(T0_US))
    small = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x" * 50}]})
    large = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "y" * 900}]})
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = []
        for body in (small.encode(), _chunked(small.encode()), small.encode()):
            async with session.post(gw.url + "/v1/x", data=body, headers=headers) as resp:
                statuses.append(resp.status)
        assert statuses == [200, 200, 429]
        assert [r.body for r in upstream.requests] == [small.encode()] * 2
        for body in (large.encode(), _chunked(large.encode())):
            async with session.post(gw.url + "/v1/x", data=body, headers=headers) as resp:
                statuses.append(resp.status)
    if too_large == "reject":
        assert statuses[3:] == [413, 413]
        assert len(upstream.requests) == 2
    else:
        assert statuses[3:] == [200, 200]  # no model: the limit does not apply
        assert [r.body for r in upstream.requests[2:]] == [large.encode()] * 2


async def test_openai_style_headers_when_asked(
    llm_upstream: LlmUpstream, start_gateway: GatewayFactory
) -> None:
    """``headers: {openai: true}``: the token limit's figures as -tokens, the request limit's
    as -requests, as the official client reads them (``with_raw_response``)."""
    limits = _tokens(1000, "    reserve: 100\n") + (
        "  calls:\n    algorithm: fixed_window\n    limit: 3\n    window: 1m\n"
        "    key: ['header:Authorization']\n"
    )
    policy = _policy(llm_upstream, limits) + "headers: {openai: true}\n"
    gw = await start_gateway(policy, clock=FakeClock(T0_US))
    client = _client(gw)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "one two"}], max_tokens=8
        )
        headers = raw.headers
        # Admitted holding its reservation (100 of 1,000); 1 of 3 calls this minute.
        assert headers["x-ratelimit-limit-tokens"] == "1000"
        assert headers["x-ratelimit-remaining-tokens"] == "900"
        assert headers["x-ratelimit-reset-tokens"] == "46m40s"  # T0: 13m20s into the hour
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-remaining-requests"] == "2"
        assert headers["x-ratelimit-reset-requests"] == "40s"
        for _ in range(2):
            await _call(client, 2, 8)
        with pytest.raises(openai.RateLimitError) as refused:
            await _call(client, 2, 8)
        assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.value.response.headers["x-ratelimit-reset-requests"] == "40s"
    finally:
        await client.close()
    await _settled(gw)
    assert await _left(gw) == 1000 - 3 * 10


async def test_the_access_log_records_the_usage_and_a_replay_charges_it(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """100 tokens an hour, calls using 30 (5 words, 25 out): the fourth finds 10 left and is
    admitted (it holds 1), the fifth finds none. The log's ``costs`` carry each usage, and
    replaying the log decides the same."""
    policy_text = _policy(
        llm_upstream, _tokens(100).replace("['header:Authorization']", "[global]")
    )
    policy_text = policy_text.replace(
        "  admin_listen: 127.0.0.1:0\n",
        "  admin_listen: 127.0.0.1:0\n  access_log: true\n  access_log_format: json\n",
    )
    gw = await start_gateway(policy_text, clock=FakeClock(T0_US))
    client = _client(gw)
    statuses = []
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        try:
            for _ in range(5):
                try:
                    await _call(client, 5, 25)
                    statuses.append(200)
                except openai.RateLimitError:
                    statuses.append(429)
        finally:
            await client.close()
    assert statuses == [200, 200, 200, 200, 429]
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    costs = {"body:openai": "30", "response:model": "test-model"}
    assert [json.loads(line).get("costs") for line in lines] == [costs] * 4 + [None]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(lines) + "\n")
    run = await replay([str(log)], [Simulation(parse_and_build(policy_text, "test.yaml"))])
    counted = run.simulations[0].counters()["tokens"]
    assert (counted["allowed"], counted["rejected"]) == (4, 1)
    # The replay counts the tokens by the model the log names, as the gateway did.
    (replayed,) = run.simulations[0].engine.limits
    (live,) = gw.gateway.handler.runtime.engine.limits
    assert replayed.counters.charged_by_model == live.counters.charged_by_model
    assert live.counters.charged_by_model == {"test-model": 100}


async def test_tokens_are_counted_by_model_in_series_bounded_whatever_clients_send(
    llm_upstream: LlmUpstream, start_gateway: GatewayFactory
) -> None:
    """``server.metrics_max_models: 3`` and calls naming 8 models (streamed and not), then
    one naming none: the first 3 have series of their own, the other 5 count as ``other``,
    the last as ``""``: 5 series per unit metric of the limit, summing to its totals. Each
    call holds 100 and uses 30 (10 words in, 20 out): 70 returned."""
    policy_text = _policy(llm_upstream, _tokens(BUDGET, "    reserve: 100\n")).replace(
        "  admin_listen: 127.0.0.1:0\n", "  admin_listen: 127.0.0.1:0\n  metrics_max_models: 3\n"
    )
    gw = await start_gateway(policy_text, clock=FakeClock(T0_US))
    client = _client(gw)
    try:
        for index in range(8):
            if index % 2:
                await _stream(client, 10, 20, model=f"model-{index}")
            else:
                await _call(client, 10, 20, model=f"model-{index}")
        await _call(client, 10, 20, model="")
    finally:
        await client.close()
    await _settled(gw)
    one = {"charged": 30, "held": 100, "returned": 70}
    expected = {f"model-{index}": one for index in range(3)}
    expected["other"] = {kind: units * 5 for kind, units in one.items()}
    expected[""] = one
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda got: (
                value(got, "gateway_limit_charged_units_total", limit="tokens", model="") == 30
            ),
        )
    (limit,) = gw.gateway.handler.runtime.engine.limits
    totals = limit.counters.charges()
    for kind in ("charged", "held", "returned"):
        series = {
            dict(labels)["model"]: count
            for (name, labels), count in samples.items()
            if name == f"gateway_limit_{kind}_units_total" and ("limit", "tokens") in labels
        }
        assert series == {model: units[kind] for model, units in expected.items()}, kind
        assert sum(series.values()) == getattr(totals, f"{kind}_units") == 9 * one[kind]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_anthropic_client_calls_are_charged_their_usage(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """The official ``anthropic`` client, streamed and not, against ``cost_from: anthropic``:
    input plus output tokens, from the body or from ``message_start`` and ``message_delta``."""
    anthropic = pytest.importorskip("anthropic")
    clock = FakeClock(T0_US)
    limit = _tokens(BUDGET, "    reserve: {body: max_tokens, default: 1000}\n").replace(
        "cost_from: openai", "cost_from: anthropic"
    )
    gw = await start_gateway(
        _policy(llm_upstream, limit),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "llm"),
    )
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-test", max_retries=0)
    rng = random.Random(3)
    try:
        for index in range(40):
            words, most = rng.randint(1, 30), rng.randint(1, 60)
            messages = [{"role": "user", "content": " ".join(["hello"] * words)}]
            if index % 2:
                message = await client.messages.create(
                    model="m", max_tokens=most, messages=messages
                )
            else:
                async with client.messages.stream(
                    model="m", max_tokens=most, messages=messages
                ) as stream:
                    message = await stream.get_final_message()
            assert message.usage.input_tokens + message.usage.output_tokens == words + most
    finally:
        await client.close()
    await _settled(gw)
    (tokens,) = gw.gateway.handler.runtime.engine.limits
    assert tokens.counters.charged_units == sum(llm_upstream.reported)
    assert await _left(gw) == BUDGET - sum(llm_upstream.reported)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


STREAM_MB = 300
RSS_GROWTH_MIB = 50


@pytest.mark.slow
@pytest.mark.reliability
async def test_a_stream_of_hundreds_of_megabytes_is_relayed_in_bounded_memory_and_charged(
    llm_upstream: LlmUpstream, gateway_process: StartGateway
) -> None:
    """A 300 MB event stream through a gateway process metering it (``cost_from``) reaches
    the client whole, its usage (in the last event) is charged, and the gateway's memory
    stays bounded: the meter keeps the unfinished event, never the stream."""
    # A process on the real clock, whose hour windows end on the wall clock's hour: one could
    # end between the two streams' charges (tens of seconds apart on a slow machine) and the
    # key's count start again. A window of 30 days leaves no boundary within the test.
    tokens = _tokens(BUDGET).replace("    window: 1h\n", "    window: 720h\n")
    template = _policy(llm_upstream, tokens).replace("{", "{{").replace("}", "}}")
    policy = template.replace(
        "listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0",
        "listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}",
    )
    gw = await gateway_process(policy=policy)
    body: dict[str, Any] = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "hello " * 5}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": "Bearer sk-test"}
    pid = gw.proc.pid
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def stream(pad: int) -> tuple[int, bytes, int]:
            """Bytes read, the stream's last bytes, the gateway's highest RSS meanwhile."""
            read, tail, peak = 0, b"", _rss_kib(pid)
            async with session.post(
                gw.url + "/v1/chat/completions", json={**body, "pad_bytes": pad}, headers=headers
            ) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_chunked(1 << 20):
                    read += len(chunk)
                    tail = (tail + chunk)[-4096:]
                    peak = max(peak, _rss_kib(pid))
            return read, tail, peak

        await stream(1 << 20)  # warm up: buffers and pools at their working size
        await wait_until(lambda: llm_upstream.calls == 1, "the warm-up answered")
        before = _rss_kib(pid)
        read, tail, peak = await stream(STREAM_MB * 1_000_000)
    print(f"{read / 1e6:.0f} MB relayed, gateway RSS {before} KiB before, {peak} KiB at most")
    assert read > STREAM_MB * 1_000_000
    assert tail.endswith(b"data: [DONE]\n\n") and b'"total_tokens": 13' in tail
    assert (peak - before) / 1024 < RSS_GROWTH_MIB, (before, peak)

    async def charged() -> bool:
        return await _left(gw) == BUDGET - 2 * 13

    await wait_until(charged, "both streams charged their usage (5 + 8 tokens each)")
