"""The per-key state table: LRU bound, incremental expiry, reload rescaling."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.token_bucket import TokenBucket
from gateway.keyed_state import KeyedState

S = 1_000_000
T0 = 2520 * S  # on a window boundary for every window length used here


def _charged(algo: FixedWindow, now_us: int) -> int:
    _, state = algo.decide(None, now_us)
    assert state is not None
    return state


def test_least_recently_used_key_is_evicted() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(3, algo)
    for key in "abc":
        table.put(key, _charged(algo, T0))
    assert table.get("a") is not None  # a is now the most recently used
    table.put("d", _charged(algo, T0))
    assert list(table) == ["c", "a", "d"]
    assert (len(table), table.evictions, table.expiries) == (3, 1, 0)
    assert table.get("b") is None


def test_peek_does_not_touch_and_none_forgets() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(2, algo)
    table.put("a", _charged(algo, T0))
    table.put("b", _charged(algo, T0))
    assert table.peek("a") is not None
    table.put("c", _charged(algo, T0))  # "a" was only peeked at: still the oldest
    assert "a" not in table and "b" in table
    table.put("b", None)
    assert list(table) == ["c"]
    table.discard("c")
    table.discard("missing")
    assert len(table) == 0


def test_rewriting_a_key_makes_it_most_recent() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(2, algo)
    table.put("a", _charged(algo, T0))
    table.put("b", _charged(algo, T0))
    table.put("a", _charged(algo, T0 + 1))
    table.put("c", _charged(algo, T0))
    assert list(table) == ["a", "c"]


def test_new_keys_expire_up_to_two_idle_keys_first() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(10, algo)
    for key in "abc":
        table.put(key, _charged(algo, T0), T0)
    later = T0 + 10 * S  # the window of a, b and c is over: all idle
    table.put("d", _charged(algo, later), later)
    assert list(table) == ["c", "d"]
    assert (table.expiries, table.evictions) == (2, 0)


def test_expiry_stops_at_the_first_busy_key() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(10, algo)
    table.put("busy", _charged(algo, T0 + 10 * S))
    table.put("idle", _charged(algo, T0))
    assert table.sweep(T0 + 10 * S, 10) == 0
    assert list(table) == ["busy", "idle"]


def test_full_table_prefers_expiring_an_idle_key_to_evicting() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(2, algo)
    table.put("old", _charged(algo, T0))
    table.put("busy", _charged(algo, T0 + 10 * S))
    table.put("new", _charged(algo, T0 + 10 * S), T0 + 10 * S)
    assert list(table) == ["busy", "new"]
    assert (table.expiries, table.evictions) == (1, 0)


def test_sweep_does_at_most_its_budget() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(100, algo)
    for index in range(10):
        table.put(f"10.0.0.{index}", _charged(algo, T0))
    assert table.sweep(T0 + 10 * S, 3) == 3
    assert len(table) == 7
    assert table.sweep(T0 + 10 * S, 100) == 7
    assert table.expiries == 10


def test_resize_evicts_the_oldest_at_once() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(5, algo)
    for key in "abcde":
        table.put(key, _charged(algo, T0))
    table.resize(2)
    assert list(table) == ["d", "e"]
    assert table.evictions == 3
    with pytest.raises(ValueError):
        table.resize(0)
    with pytest.raises(ValueError):
        KeyedState(0, algo)


def test_rescale_carries_states_and_drops_fresh_ones() -> None:
    old = FixedWindow(10, 10)
    table = KeyedState(10, old)
    busy = None
    for _ in range(4):
        _, busy = old.decide(busy, T0)
    assert busy is not None
    table.put("busy", busy)
    table.put("stale", _charged(old, T0 - 10 * S))
    new = FixedWindow(20, 10)
    table.rescale(new, old, T0 + S)
    assert table.algorithm is new
    assert list(table) == ["busy"]  # the stale key's window was over: it starts afresh
    assert new.unpack_state(table.peek("busy") or 0)[1] == 8


def test_an_evicted_key_starts_afresh() -> None:
    """Like a full nginx zone: the bound on memory is also a bound on memory of past use."""
    algo = FixedWindow(1, 10)
    table = KeyedState(1, algo)
    table.put("a", _charged(algo, T0))
    assert not algo.decide(table.get("a"), T0)[0].allowed
    table.put("b", _charged(algo, T0))
    assert algo.decide(table.get("a"), T0)[0].allowed


class ReferenceTable:
    """The table's rules restated with a list: LRU order, up to two idle keys expired on each
    new key, then the oldest evicted while full."""

    def __init__(self, max_keys: int, algo: SlidingLog) -> None:
        self.max_keys = max_keys
        self.algo = algo
        self.order: list[str] = []
        self.states: dict[str, bytes] = {}

    def touch(self, key: str) -> None:
        if key in self.states:
            self.order.remove(key)
            self.order.append(key)

    def put(self, key: str, state: bytes, now_us: int) -> None:
        if key in self.states:
            self.touch(key)
        else:
            for _ in range(2):
                if self.order and self.algo.is_idle(self.states[self.order[0]], now_us):
                    del self.states[self.order.pop(0)]
                else:
                    break
            while len(self.order) >= self.max_keys:
                del self.states[self.order.pop(0)]
            self.order.append(key)
        self.states[key] = state


operations = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 400_000), st.integers(1, 2)),
    min_size=1,
    max_size=250,
)


@settings(deadline=None)
@given(max_keys=st.integers(1, 6), limit=st.integers(1, 4), steps=operations)
def test_eviction_never_lets_a_tracked_key_exceed_its_limit(
    max_keys: int, limit: int, steps: list[tuple[int, int, int]]
) -> None:
    window_us = S
    algo = SlidingLog(limit, window_us / S)
    table = KeyedState(max_keys, algo)
    reference = ReferenceTable(max_keys, algo)
    # Units admitted to each key since it was last (re)tracked.
    spans: dict[str, list[tuple[int, int]]] = {}
    now_us = T0
    for key_index, gap_us, cost in steps:
        now_us += gap_us
        key = f"192.0.2.{key_index}"
        if key not in table:
            spans[key] = []
        state = table.get(key)
        reference.touch(key)
        decision, new_state = algo.decide(state, now_us, cost)
        if decision.allowed:
            assert new_state is not None
            table.put(key, new_state, now_us)
            reference.put(key, new_state, now_us)
            spans[key].append((now_us, cost))
        assert list(table) == reference.order
        assert len(table) <= max_keys
        assert all(table.peek(k) == reference.states[k] for k in reference.order)
    for key in table:
        admitted = spans[key]
        for start_us, _ in admitted:
            in_window = sum(c for t, c in admitted if start_us <= t < start_us + window_us)
            assert in_window <= limit


@settings(deadline=None)
@given(max_keys=st.integers(1, 4), steps=operations)
def test_token_bucket_keys_stay_within_their_bucket_while_tracked(
    max_keys: int, steps: list[tuple[int, int, int]]
) -> None:
    capacity, rate = 3, 2  # tokens, per second
    algo = TokenBucket(rate, 1, capacity)
    table = KeyedState(max_keys, algo)
    spans: dict[str, list[tuple[int, int]]] = {}
    now_us = T0
    for key_index, gap_us, cost in steps:
        now_us += gap_us
        key = f"198.51.100.{key_index}"
        if key not in table:
            spans[key] = []
        decision, new_state = algo.decide(table.get(key), now_us, cost)
        if decision.allowed:
            table.put(key, new_state, now_us)
            spans[key].append((now_us, cost))
        # Checked after every step: the span of a key is over once it is evicted.
        for tracked in table:
            admitted = spans[tracked]
            for i, (start_us, _) in enumerate(admitted):
                units = 0
                for end_us, units_cost in admitted[i:]:
                    units += units_cost
                    assert units * S <= capacity * S + rate * (end_us - start_us)
