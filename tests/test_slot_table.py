"""The in-process state of a concurrency limit: slots per key, never evicted, driven by hand
through the algorithm as the memory store drives it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.concurrency import Concurrency
from gateway.stores.slot_table import SlotTable

NOW = 1_000_000_000


def take(table: SlotTable, key: str, cost: int = 1) -> bool:
    """What the memory store does for one concurrency check: decide, commit if admitted."""
    decision, state = table.algorithm.decide(table.get(key), NOW, cost)
    if decision.allowed:
        table.put(key, state)
    return decision.allowed


def test_takes_up_to_the_limit_per_key_and_keys_are_apart() -> None:
    table = SlotTable(100, Concurrency(2))
    assert take(table, "a") and take(table, "a")
    assert not take(table, "a")
    assert take(table, "b")
    assert (table.held("a"), table.held("b"), table.slots_in_use) == (2, 1, 3)


def test_a_key_is_forgotten_when_it_holds_nothing() -> None:
    table = SlotTable(100, Concurrency(2))
    assert take(table, "a", 2)
    table.release("a", 1)
    assert table.get("a") == 1
    table.release("a", 1)
    assert len(table) == 0 and table.get("a") is None and table.slots_in_use == 0
    # A release for a key not held (the limit was started afresh) changes nothing.
    table.release("a", 1)
    assert table.slots_in_use == 0


def test_a_full_table_refuses_new_keys_and_evicts_none() -> None:
    table = SlotTable(2, Concurrency(5))
    assert take(table, "a") and take(table, "b")
    assert table.peek("c") == 5  # a new key reads as holding every slot
    assert table.refusals == 0  # a look counts nothing
    assert not take(table, "c")
    assert table.refusals == 1
    assert take(table, "a")  # keys already tracked go on
    assert sorted(table.held_keys()) == ["a", "b"]
    table.release("b", 1)
    assert take(table, "c")


def test_a_smaller_bound_keeps_the_slots_held() -> None:
    table = SlotTable(3, Concurrency(1))
    assert take(table, "a") and take(table, "b")
    table.resize(1)
    assert len(table) == 2 and table.slots_in_use == 2
    assert not take(table, "c")
    table.release("a", 1)
    table.release("b", 1)
    assert take(table, "c")


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SlotTable(0, Concurrency(1))
    with pytest.raises(ValueError):
        SlotTable(1, Concurrency(1)).resize(0)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.sampled_from("abcd"), st.integers(1, 3)),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    min_size=10,
    max_size=120,
)


@settings(max_examples=200)
@given(limit=st.integers(1, 5), max_keys=st.integers(1, 4), script=steps)
def test_a_model_of_the_table_agrees_at_every_step(
    limit: int, max_keys: int, script: list[tuple]
) -> None:
    """Against a plain model: never more than the limit held per key, never more keys than
    ``max_keys``, and once every request has given its slots back, nothing held and no key."""
    table = SlotTable(max_keys, Concurrency(limit))
    holders: list[tuple[str, int]] = []
    for step in script:
        if step[0] == "take":
            _, key, cost = step
            held = sum(c for k, c in holders if k == key)
            keys = {k for k, _ in holders}
            fits = held + cost <= limit and (key in keys or len(keys) < max_keys)
            assert take(table, key, cost) == fits
            if fits:
                holders.append((key, cost))
        elif holders:
            key, cost = holders.pop(step[1] % len(holders))
            table.release(key, cost)
        for key in "abcd":
            assert table.held(key) == sum(c for k, c in holders if k == key) <= limit
        assert len(table) == len({k for k, _ in holders}) <= max_keys
        assert table.slots_in_use == sum(cost for _, cost in holders)
    while holders:
        key, cost = holders.pop()
        table.release(key, cost)
    assert (len(table), table.slots_in_use) == (0, 0)
