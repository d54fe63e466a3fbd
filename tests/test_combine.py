"""Several limits on one request: nginx's rule, checked by hand and against a transcription of
``ngx_http_limit_req_handler`` / ``_lookup`` / ``_account`` (nodes, counts and all)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.algorithms.base import Decision
from gateway.algorithms.combine import combine, decide_all
from gateway.algorithms.leaky_bucket import LeakyBucket, pack_state, unpack_state

MS = 1000
T0_US = 1_000_000_000_000


def test_a_request_rejected_by_one_limit_is_charged_to_none() -> None:
    per_client = LeakyBucket.from_nginx("10r/s", burst=5)
    per_site = LeakyBucket.from_nginx("1r/s")  # burst 0
    client_state = pack_state(2000, T0_US // MS)
    site_state = pack_state(0, T0_US // MS)  # one request just taken
    result = decide_all([(per_client, client_state), (per_site, site_state)], T0_US)
    assert not result.allowed
    assert result.rejected_by == (1,)
    assert result.states == (client_state, site_state)
    # the client limit alone would have admitted it (2000 + 1000 <= 5000), yet nothing is charged
    assert result.decisions[0].allowed
    assert result.delay_s == 0.0 and result.delayed_by is None
    # the site frees up 1 s after its last request
    assert result.retry_after_s == 1.0


def test_every_rejecting_limit_is_named_and_retry_after_waits_for_the_slowest() -> None:
    fast = LeakyBucket.from_nginx("10r/s")
    slow = LeakyBucket.from_nginx("1r/s")
    full = pack_state(0, T0_US // MS)
    result = decide_all([(fast, full), (slow, full)], T0_US + 50 * MS)
    assert result.rejected_by == (0, 1)
    # fast: 1000 milli at 10000 milli/s -> free at +100 ms (50 ms from now); slow: at +1000 ms
    assert [d.retry_after_s for d in result.decisions] == [0.05, 0.95]
    assert result.retry_after_s == 0.95


def test_an_admitted_request_is_charged_to_all_and_the_longest_delay_wins() -> None:
    a = LeakyBucket.from_nginx("2r/s", burst=5)  # delay excess * 1000 // 2000
    b = LeakyBucket.from_nginx("4r/s", burst=5)  # delay excess * 1000 // 4000
    c = LeakyBucket.from_nginx("1r/s", burst=5, nodelay=True)
    now_ms = T0_US // MS
    states = (pack_state(1000, now_ms), pack_state(3000, now_ms), pack_state(4000, now_ms))
    result = decide_all(list(zip((a, b, c), states, strict=True)), T0_US)
    assert result.allowed and result.rejected_by == ()
    # excess: a 2000 -> 1000 ms, b 4000 -> 1000 ms, c 5000 -> nodelay
    assert [d.delay_s for d in result.decisions] == [1.0, 1.0, 0.0]
    assert result.delay_s == 1.0
    assert result.delayed_by == 1  # a tie: nginx names the later zone
    assert [unpack_state(s)[0] for s in result.states] == [2000, 4000, 5000]


def test_combine_takes_decisions_by_the_same_rule() -> None:
    """``combine`` (a store's script reply, a lease, a store's rejection) names the later of
    equal delays and charges a rejected request to no limit, as ``decide_all`` does."""
    a = LeakyBucket.from_nginx("2r/s", burst=5)
    b = LeakyBucket.from_nginx("4r/s", burst=5)
    now_ms = T0_US // MS
    states = [pack_state(1000, now_ms), pack_state(3000, now_ms)]
    taken = [a.decide(states[0], T0_US), b.decide(states[1], T0_US)]
    result = combine([d for d, _ in taken], [s for _, s in taken], states, T0_US)
    assert result == decide_all(list(zip((a, b), states, strict=True)), T0_US, stamp_us=T0_US)
    assert result.delay_s == 1.0 and result.delayed_by == 1
    full = pack_state(5000, now_ms)  # burst 5 used up: the next request is rejected
    taken = [a.decide(states[0], T0_US), b.decide(full, T0_US)]
    result = combine([d for d, _ in taken], [s for _, s in taken], [states[0], full], T0_US)
    assert not result.allowed and result.rejected_by == (1,)
    assert result.states == (states[0], full)


def test_no_limits_means_allowed_at_once() -> None:
    result = decide_all([], T0_US)
    assert result.allowed and result.delay_s == 0.0 and result.states == ()


@dataclass
class QuotaPerInstant:
    """A second, unrelated Algorithm: at most ``quota`` units per exact microsecond."""

    quota: int
    name: str = "quota_per_instant"

    def decide(
        self, state: tuple[int, int] | None, now_us: int, cost: int = 1
    ) -> tuple[Decision, tuple[int, int] | None]:
        used = state[1] if state is not None and state[0] == now_us else 0
        if used + cost > self.quota:
            return Decision(False, 0.0, 1e-6, self.quota, 0, 1e-6), state
        return Decision(True, 0.0, 0.0, self.quota, self.quota - used - cost, 1e-6), (
            now_us,
            used + cost,
        )

    def is_idle(self, state: tuple[int, int], now_us: int) -> bool:
        return state[0] != now_us

    def refund(self, state: tuple[int, int], now_us: int, cost: int = 1) -> tuple[int, int]:
        return state[0], max(0, state[1] - cost)

    def rescale(self, state: tuple[int, int], previous: object, now_us: int) -> None:
        return None


def test_any_algorithm_combines_with_the_leaky_bucket() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=5)
    quota = QuotaPerInstant(quota=2)
    bucket_state: int | None = None
    quota_state: tuple[int, int] | None = None
    allowed = []
    for _ in range(4):
        result = decide_all([(bucket, bucket_state), (quota, quota_state)], T0_US, cost=1)
        bucket_state, quota_state = result.states
        allowed.append(result.allowed)
    assert allowed == [True, True, False, False]
    # the two rejections charged the bucket nothing: excess 0 then 1000, no more
    assert bucket_state is not None and unpack_state(bucket_state)[0] == 1000


# --- nginx, transcribed ---------------------------------------------------------------------------
# A line-by-line port of ngx_http_limit_req_module.c (1.15.7+) with its shared-memory nodes,
# used as the reference the combination must match on random traffic. C integer semantics: all
# divisions here are of non-negative values, where Python's // equals C's /.


@dataclass
class Node:
    excess: int
    last: int
    count: int


@dataclass
class Zone:
    rate: int  # milli-requests per second
    nodes: dict[str, Node] = field(default_factory=dict)
    pinned: Node | None = None  # ctx->node


@dataclass
class Limit:
    zone: Zone
    burst: int  # burst * 1000
    delay: int  # delay * 1000, or NGX_MAX_INT_T_VALUE / 1000 * 1000 for nodelay


NGX_OK, NGX_AGAIN, NGX_BUSY = "OK", "AGAIN", "BUSY"


def ngx_ms(now: int, last: int) -> int:
    ms = now - last
    if ms < -60000:
        ms = 1
    elif ms < 0:
        ms = 0
    return ms


def ngx_lookup(limit: Limit, key: str, now: int, account: bool) -> tuple[str, int]:
    ctx = limit.zone
    lr = ctx.nodes.get(key)
    if lr is not None:
        ms = ngx_ms(now, lr.last)
        excess = lr.excess - ctx.rate * ms // 1000 + 1000
        if excess < 0:
            excess = 0
        if excess > limit.burst:
            return NGX_BUSY, excess
        if account:
            lr.excess = excess
            if ms:
                lr.last = now
            return NGX_OK, excess
        lr.count += 1
        ctx.pinned = lr
        return NGX_AGAIN, excess
    lr = Node(excess=0, last=0, count=0)
    ctx.nodes[key] = lr
    if account:
        lr.last = now
        lr.count = 0
        return NGX_OK, 0
    lr.last = 0
    lr.count = 1
    ctx.pinned = lr
    return NGX_AGAIN, 0


def ngx_account(limits: list[Limit], n: int, excess: int, limit: Limit, now: int) -> int:
    max_delay = 0 if excess <= limit.delay else (excess - limit.delay) * 1000 // limit.zone.rate
    while n:
        n -= 1
        ctx = limits[n].zone
        lr = ctx.pinned
        if lr is None:
            continue
        ms = ngx_ms(now, lr.last)
        excess = lr.excess - ctx.rate * ms // 1000 + 1000
        if excess < 0:
            excess = 0
        if ms:
            lr.last = now
        lr.excess = excess
        lr.count -= 1
        ctx.pinned = None
        if excess <= limits[n].delay:
            continue
        delay = (excess - limits[n].delay) * 1000 // ctx.rate
        if delay > max_delay:
            max_delay = delay
    return max_delay


def ngx_unlock(limits: list[Limit], n: int) -> None:
    while n:
        n -= 1
        ctx = limits[n].zone
        if ctx.pinned is None:
            continue
        ctx.pinned.count -= 1
        ctx.pinned = None


def ngx_handler(limits: list[Limit], key: str, now: int) -> tuple[bool, int]:
    """(admitted, delay ms) for one request, mutating the zones as nginx does."""
    rc = NGX_AGAIN
    excess = 0
    n = 0
    for n in range(len(limits)):  # n is read after the loop, as in C
        rc, excess = ngx_lookup(limits[n], key, now, n == len(limits) - 1)
        if rc != NGX_AGAIN:
            break
    if rc == NGX_BUSY:
        ngx_unlock(limits, n)
        return False, 0
    return True, ngx_account(limits, n, excess, limits[n], now)


NODELAY_MILLI = (2**63 - 1) // 1000 * 1000

limit_params = st.tuples(
    st.integers(1, 30),  # rate
    st.sampled_from([1, 60]),  # period
    st.integers(0, 6),  # burst
    st.one_of(st.none(), st.integers(0, 6)),  # delay (None: nodelay)
)
# Mostly forward in small steps, sometimes idle, sometimes the clock steps or jumps back.
steps_us = st.one_of(
    st.integers(0, 400_000),
    st.integers(0, 5_000),
    st.integers(0, 90_000_000),
    st.integers(-70_000_000, -1),
)


@given(
    params=st.lists(limit_params, min_size=1, max_size=3),
    traffic=st.lists(st.tuples(steps_us, st.sampled_from("abc")), min_size=1, max_size=120),
)
def test_decide_all_matches_nginx_transcribed(
    params: list[tuple[int, int, int, int | None]], traffic: list[tuple[int, str]]
) -> None:
    buckets = [LeakyBucket(rate, period, burst, delay) for rate, period, burst, delay in params]
    limits = [
        Limit(
            Zone(rate * 1000 // period),
            burst * 1000,
            NODELAY_MILLI if delay is None else delay * 1000,
        )
        for rate, period, burst, delay in params
    ]
    states: dict[str, list[int | None]] = {}
    now_us = T0_US
    for step, key in traffic:
        now_us += step
        key_states = states.setdefault(key, [None] * len(buckets))
        result = decide_all(list(zip(buckets, key_states, strict=True)), now_us)
        admitted, delay_ms = ngx_handler(limits, key, now_us // MS)
        assert result.allowed == admitted
        assert result.delay_s == delay_ms / 1000
        if admitted:
            assert result.delay_s == max(d.delay_s for d in result.decisions)
        else:
            assert list(result.states) == key_states
        states[key] = list(result.states)
        for bucket_state, limit in zip(states[key], limits, strict=True):
            node = limit.zone.nodes.get(key)
            if bucket_state is None:
                # nginx may hold a node made by a lookup that a later zone rejected: excess 0,
                # last 0, which drains to "new" at once; we hold nothing.
                assert node is None or (node.excess, node.last) == (0, 0)
            else:
                assert node is not None
                assert unpack_state(bucket_state) == (node.excess, node.last)
            assert node is None or node.count == 0


@given(
    params=st.lists(limit_params, min_size=2, max_size=3),
    traffic=st.lists(st.tuples(st.integers(0, 300_000), st.integers(1, 3)), max_size=80),
)
def test_costly_requests_are_all_or_nothing_across_limits(
    params: list[tuple[int, int, int, int | None]], traffic: list[tuple[int, int]]
) -> None:
    buckets = [LeakyBucket(rate, period, burst, delay) for rate, period, burst, delay in params]
    states: list[int | None] = [None] * len(buckets)
    now_us = T0_US
    for step, cost in traffic:
        now_us += step
        result = decide_all(list(zip(buckets, states, strict=True)), now_us, cost=cost)
        alone = [b.decide(s, now_us, cost) for b, s in zip(buckets, states, strict=True)]
        assert result.decisions == tuple(decision for decision, _ in alone)
        assert result.allowed == all(decision.allowed for decision, _ in alone)
        assert result.rejected_by == tuple(
            i for i, (decision, _) in enumerate(alone) if not decision.allowed
        )
        if result.allowed:
            assert result.states == tuple(new for _, new in alone)
        else:
            assert result.states == tuple(states)
            assert result.retry_after_s == pytest.approx(
                max(alone[i][0].retry_after_s for i in result.rejected_by)
            )
        states = list(result.states)
