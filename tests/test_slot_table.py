"""The in-process state of a concurrency limit: slots per key, and first-come-first-served
waiters, driven by hand."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.concurrency import Concurrency
from gateway.stores.slot_table import SlotTable

NOW = 1_000_000_000


def test_takes_up_to_the_limit_per_key_and_keys_are_apart() -> None:
    table: SlotTable[str] = SlotTable(100, Concurrency(2))
    assert table.take("a", 1, NOW).allowed
    assert table.take("a", 1, NOW).allowed
    rejected = table.take("a", 1, NOW)
    assert not rejected.allowed
    assert rejected.retry_after_s == 1.0
    assert table.take("b", 1, NOW).allowed
    assert (table.held("a"), table.held("b"), table.slots_in_use) == (2, 1, 3)


def test_a_key_is_forgotten_when_it_holds_nothing_and_nobody_waits() -> None:
    table: SlotTable[str] = SlotTable(100, Concurrency(2))
    table.take("a", 2, NOW)
    assert len(table) == 1
    assert table.release("a", 1) == []
    assert table.state("a") == 1
    table.release("a", 1)
    assert len(table) == 0
    assert table.state("a") is None
    assert table.slots_in_use == 0
    # A release for a key not held (the limit was started afresh) changes nothing.
    assert table.release("a", 1) == []
    assert table.slots_in_use == 0


def test_a_release_grants_the_waiters_in_order_while_the_front_fits() -> None:
    table: SlotTable[str] = SlotTable(100, Concurrency(3))
    table.take("k", 3, NOW)
    assert table.wait("k", "first", 2)
    assert table.wait("k", "second", 1)
    assert table.wait("k", "third", 1)
    assert table.waiters == 3
    # One slot back: the front needs two, so nobody behind it jumps the line.
    assert table.release("k", 1) == []
    assert table.release("k", 1) == ["first"]
    assert table.held("k") == 3
    assert table.release("k", 2) == ["second", "third"]
    assert table.held("k") == 3
    assert table.waiters == 0
    assert table.slots_in_use == 3


def test_a_newcomer_waits_behind_those_already_waiting_even_if_it_would_fit() -> None:
    table: SlotTable[str] = SlotTable(100, Concurrency(3))
    table.take("k", 2, NOW)
    table.wait("k", "big", 2)
    assert not table.take("k", 1, NOW).allowed
    assert table.held("k") == 2


def test_a_waiter_that_leaves_unblocks_those_behind_it() -> None:
    table: SlotTable[str] = SlotTable(100, Concurrency(3))
    table.take("k", 2, NOW)
    table.wait("k", "big", 2)
    table.wait("k", "small", 1)
    assert table.leave("k", "big") == ["small"]
    assert table.held("k") == 3
    assert table.leave("k", "gone") == []  # not waiting (any more): nothing changes
    assert table.leave("other", "big") == []


def test_a_full_table_refuses_new_keys_and_evicts_none() -> None:
    table: SlotTable[str] = SlotTable(2, Concurrency(5))
    table.take("a", 1, NOW)
    table.take("b", 1, NOW)
    assert not table.has_room("c")
    assert not table.take("c", 1, NOW).allowed
    assert not table.wait("c", "t", 1)
    assert table.refusals == 2
    assert table.take("a", 1, NOW).allowed  # keys already tracked go on
    assert sorted(table.keys()) == ["a", "b"]
    table.release("b", 1)
    assert table.take("c", 1, NOW).allowed


def test_a_waiter_needing_more_than_the_limit_is_refused() -> None:
    table: SlotTable[str] = SlotTable(10, Concurrency(2))
    assert not table.wait("k", "huge", 3)
    assert len(table) == 0


def test_put_commits_a_state_decided_elsewhere() -> None:
    table: SlotTable[str] = SlotTable(10, Concurrency(4))
    table.put("k", 3)
    assert table.slots_in_use == 3
    table.put("k", 1)
    assert table.slots_in_use == 1
    table.put("k", 0)
    assert len(table) == 0 and table.slots_in_use == 0
    table.put("never", 0)
    assert len(table) == 0


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SlotTable(0, Concurrency(1))


# One step: a request arriving under a key with a cost, and waiting if refused or not;
# ("release", index) of a holder; ("leave", index) of a waiter.
arrivals = st.tuples(st.just("arrive"), st.sampled_from("ab"), st.integers(1, 3), st.booleans())
steps = st.lists(
    st.one_of(
        arrivals,
        arrivals,  # twice as likely as a release or a leave: lines form
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("leave"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=150,
)


@settings(max_examples=200)
@given(limit=st.integers(1, 6), script=steps)
def test_a_model_of_the_table_agrees_at_every_step(limit: int, script: list[tuple]) -> None:
    """Against a plain model: never more than the limit held per key, grants strictly in
    arrival order, and once every request has left, nothing held, nobody waiting, no key."""
    table: SlotTable[int] = SlotTable(100, Concurrency(limit))
    holders: list[tuple[str, int]] = []  # (key, cost) of requests holding slots
    lines: dict[str, deque[tuple[int, int]]] = {"a": deque(), "b": deque()}
    waiting: list[tuple[str, int]] = []  # (key, ticket) of waiting requests
    tickets = iter(range(10**6))

    def expect_grants(key: str, granted: list[int]) -> None:
        held = sum(cost for k, cost in holders if k == key)
        expected = []
        line = lines[key]
        while line and held + line[0][1] <= limit:
            ticket, cost = line.popleft()
            held += cost
            expected.append(ticket)
            holders.append((key, cost))
            waiting.remove((key, ticket))
        assert granted == expected

    for step in script:
        if step[0] == "arrive":
            _, key, cost, may_wait = step
            held = sum(c for k, c in holders if k == key)
            decision = table.take(key, cost, NOW)
            assert decision.allowed == (held + cost <= limit and not lines[key])
            if decision.allowed:
                holders.append((key, cost))
            elif may_wait:
                ticket = next(tickets)
                assert table.wait(key, ticket, cost) == (cost <= limit)
                if cost <= limit:
                    lines[key].append((ticket, cost))
                    waiting.append((key, ticket))
        elif step[0] == "release" and holders:
            key, cost = holders.pop(step[1] % len(holders))
            expect_grants(key, table.release(key, cost))
        elif step[0] == "leave" and waiting:
            key, ticket = waiting.pop(step[1] % len(waiting))
            lines[key] = deque(entry for entry in lines[key] if entry[0] != ticket)
            expect_grants(key, table.leave(key, ticket))
        for key in "ab":
            held = sum(cost for k, cost in holders if k == key)
            assert table.held(key) == held <= limit
            assert table.waiting(key) == len(lines[key])
        assert table.slots_in_use == sum(cost for _, cost in holders)
        assert table.waiters == len(waiting)
    while waiting:
        key, ticket = waiting.pop()
        lines[key] = deque(entry for entry in lines[key] if entry[0] != ticket)
        expect_grants(key, table.leave(key, ticket))
    while holders:
        key, cost = holders.pop()
        expect_grants(key, table.release(key, cost))
    assert (len(table), table.slots_in_use, table.waiters) == (0, 0, 0)
