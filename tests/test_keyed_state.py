"""The per-key state table: generational bound, incremental expiry, reload rescaling."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.token_bucket import TokenBucket
from gateway.stores.keyed_state import KeyedState

S = 1_000_000
T0 = 2520 * S  # on a window boundary for every window length used here


def _charged(algo: FixedWindow, now_us: int) -> int:
    _, state = algo.decide(None, now_us)
    assert state is not None
    return state


def test_a_key_not_used_for_two_generations_is_evicted() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(4, algo)
    assert table.generation_keys == 2
    for key in "abcd":  # two rotations: a and b are the oldest generation, c and d the middle
        table.put(key, _charged(algo, T0))
    assert table.get("a") is not None  # a is used again: young
    table.put("e", _charged(algo, T0))  # young is full: b, the oldest left, goes; rotation
    assert list(table) == ["c", "d", "a", "e"]
    assert (len(table), table.evictions, table.expiries) == (4, 1, 0)
    assert table.get("b") is None


def test_the_oldest_generation_empties_into_the_middle_one_as_young_fills() -> None:
    """Keys used again out of the middle generation fill ``young`` without emptying ``old``:
    old keys move to ``mid`` (to be looked at first next time), so that ``old`` is empty at
    rotation and nothing is evicted before the table is full."""
    algo = FixedWindow(5, 10)
    table = KeyedState(4, algo)
    for key in "abcd":
        table.put(key, _charged(algo, T0))
    assert table.get("c") is not None
    assert table.get("d") is not None  # young is full: rotation
    assert (len(table), table.evictions) == (4, 0)
    assert list(table) == ["b", "a", "c", "d"]  # a and b moved to mid, last in first out
    table.put("e", _charged(algo, T0))
    assert (set(table), table.evictions) == ({"b", "c", "d", "e"}, 1)


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
    assert list(table) == ["a", "d"]  # young is looked at from its end
    assert (table.expiries, table.evictions) == (2, 0)


def test_expiry_stops_at_the_first_busy_key() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(4, algo)
    for key, charged_us in (("idle", T0), ("busy", T0 + 10 * S), ("c", T0), ("d", T0)):
        table.put(key, _charged(algo, charged_us))
    assert list(table) == ["idle", "busy", "c", "d"]  # the oldest generation, then the middle
    assert table.sweep(T0 + 10 * S, 10) == 0  # old is looked at from its end: busy stops it
    assert table.sweep(T0 + 10 * S, 10) == 0  # busy, set aside, is looked at first
    assert set(table) == {"idle", "busy", "c", "d"}
    assert table.sweep(T0 + 20 * S, 10) == 2  # both old keys; the middle generation waits
    assert list(table) == ["c", "d"]


def test_expiry_looks_at_young_once_the_older_generations_are_empty() -> None:
    algo = FixedWindow(5, 10)
    table = KeyedState(10, algo)
    table.put("idle", _charged(algo, T0))
    table.put("busy", _charged(algo, T0 + 10 * S))
    assert table.sweep(T0 + 10 * S, 10) == 0
    table.put("idle2", _charged(algo, T0))
    assert table.sweep(T0 + 10 * S, 10) == 1
    assert list(table) == ["idle", "busy"]


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
    assert set(table) == {"d", "e"}  # the young generation
    assert (table.evictions, table.generation_keys) == (3, 1)
    table.put("f", _charged(algo, T0))
    assert len(table) == 2 and "f" in table
    table.resize(100)  # a larger bound keeps every key and evicts nothing
    assert (len(table), table.evictions, table.generation_keys) == (2, 4, 50)
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


class Recency:
    """The keys in order of last use (a ``get`` that finds the key, or a ``put``), the most
    recent last, and the state each was last given."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    def use(self, key: str, state: Any) -> None:
        self.states.pop(key, None)
        self.states[key] = state

    def forget(self, key: str) -> None:
        self.states.pop(key, None)

    def most_recent(self, count: int) -> list[str]:
        return list(self.states)[-count:] if count else []


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
    recency = Recency()
    # Units admitted to each key since it was last (re)tracked.
    spans: dict[str, list[tuple[int, int]]] = {}
    now_us = T0
    for key_index, gap_us, cost in steps:
        now_us += gap_us
        key = f"192.0.2.{key_index}"
        if key not in table:
            spans[key] = []
            recency.forget(key)
        state = table.get(key)
        if state is not None:
            recency.use(key, state)
        decision, new_state = algo.decide(state, now_us, cost)
        if decision.allowed:
            assert new_state is not None
            table.put(key, new_state, now_us)
            recency.use(key, new_state)
            spans[key].append((now_us, cost))
        assert len(table) <= max_keys
        for recent in recency.most_recent(table.generation_keys):
            # Never evicted; dropped only once idle (a fresh key would decide the same).
            assert recent in table or algo.is_idle(recency.states[recent], now_us)
        assert all(table.peek(k) == recency.states[k] for k in table)
    for key in table:
        admitted = spans[key]
        for start_us, _ in admitted:
            in_window = sum(c for t, c in admitted if start_us <= t < start_us + window_us)
            assert in_window <= limit


table_operations = st.lists(
    st.tuples(st.sampled_from(["get", "put", "peek", "discard"]), st.integers(0, 15)),
    min_size=1,
    max_size=300,
)


@settings(deadline=None)
@given(max_keys=st.integers(1, 9), steps=table_operations)
def test_the_most_recently_used_half_is_never_evicted(
    max_keys: int, steps: list[tuple[str, int]]
) -> None:
    """The guarantee that replaces exact LRU order: every key among the ceil(max_keys / 2)
    most recently used is tracked (here no state is ever idle: nothing expires); the table
    never holds more than ``max_keys`` and evicts only to make room for a new key once full;
    every key that left was discarded or counted."""
    algo = FixedWindow(1000, 3600)
    table = KeyedState(max_keys, algo)
    assert table.generation_keys == (max_keys + 1) // 2
    recency = Recency()
    discarded = became_tracked = 0
    for step, (operation, key_index) in enumerate(steps):
        key = f"203.0.113.{key_index}"
        was_tracked = key in table
        if operation == "get":
            state = table.get(key)
            assert (state is not None) == was_tracked
            if state is not None:
                recency.use(key, state)
        elif operation == "put":
            evictions = table.evictions
            table.put(key, step, T0)
            if table.evictions > evictions:  # as in an nginx zone: only once full
                assert (table.evictions - evictions, len(table)) == (1, max_keys)
            recency.use(key, step)
            became_tracked += not was_tracked
        elif operation == "peek":
            assert table.peek(key) == (recency.states[key] if was_tracked else None)
        else:
            table.discard(key)
            recency.forget(key)
            discarded += was_tracked
        assert len(table) <= max_keys
        assert set(recency.most_recent(table.generation_keys)) <= set(table)
        for gone in [k for k in recency.states if k not in table]:
            recency.forget(gone)
        assert sorted(table) == sorted(recency.states)
        assert all(table.peek(k) == recency.states[k] for k in table)
        assert table.expiries == 0
        assert table.evictions + discarded + len(table) == became_tracked


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
