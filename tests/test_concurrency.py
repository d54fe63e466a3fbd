"""The concurrency algorithm (nginx ``limit_conn``'s count): slots taken and given back."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.algorithms.concurrency import Concurrency

NOW = 1_000_000_000


def test_limit_slots_then_the_next_is_rejected_and_charged_nothing() -> None:
    algo = Concurrency(3, retry_after_s=2.0)
    state = None
    remaining = []
    for _ in range(3):
        decision, state = algo.decide(state, NOW)
        assert decision.allowed
        assert decision.delay_s == 0.0
        remaining.append(decision.remaining)
    assert remaining == [2, 1, 0]
    assert state == 3
    decision, after = algo.decide(state, NOW)
    assert not decision.allowed
    assert after == 3  # a rejection takes no slot
    assert decision.retry_after_s == 2.0
    assert (decision.limit, decision.remaining) == (3, 0)


def test_a_slot_given_back_admits_the_next() -> None:
    algo = Concurrency(2)
    _, state = algo.decide(None, NOW)
    _, state = algo.decide(state, NOW)
    assert state is not None
    assert not algo.decide(state, NOW)[0].allowed
    state = algo.refund(state, NOW)
    decision, state = algo.decide(state, NOW)
    assert decision.allowed and state == 2


def test_time_alone_frees_nothing() -> None:
    algo = Concurrency(1)
    _, state = algo.decide(None, NOW)
    assert state == 1
    assert not algo.decide(state, NOW + 3600 * 1_000_000)[0].allowed
    assert not algo.is_idle(1, NOW + 3600 * 1_000_000)
    assert algo.is_idle(0, NOW)


def test_cost_takes_that_many_slots_and_more_than_the_limit_never_fits() -> None:
    algo = Concurrency(5)
    decision, state = algo.decide(None, NOW, cost=3)
    assert decision.allowed and state == 3 and decision.remaining == 2
    decision, same = algo.decide(state, NOW, cost=3)
    assert not decision.allowed and same == 3
    assert decision.retry_after_s == 1.0
    decision, _ = algo.decide(None, NOW, cost=6)
    assert not decision.allowed
    assert math.isinf(decision.retry_after_s)  # no wait can make it fit
    assert algo.refund(3, NOW, cost=3) == 0
    with pytest.raises(ValueError):
        algo.decide(None, NOW, cost=0)


def test_refund_never_goes_below_none_held() -> None:
    assert Concurrency(4).refund(1, NOW, cost=3) == 0


def test_a_reload_keeps_the_slots_in_flight_even_above_a_lowered_limit() -> None:
    before, after = Concurrency(10), Concurrency(2)
    assert after.rescale(7, before, NOW) == 7
    assert not after.decide(7, NOW)[0].allowed
    assert after.rescale(0, before, NOW) is None


def test_share_divides_the_slots_rounding_down_but_keeps_one() -> None:
    assert Concurrency(10).share(3) == Concurrency(3)
    assert Concurrency(2).share(5) == Concurrency(1)
    algo = Concurrency(4)
    assert algo.share(1) is algo


def test_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        Concurrency(0)
    with pytest.raises(ValueError):
        Concurrency(2, retry_after_s=-1.0)
    assert Concurrency(2, 1.0) == Concurrency(2, 1.0) != Concurrency(3, 1.0)
    assert hash(Concurrency(2, 1.0)) == hash(Concurrency(2, 1.0))


@given(
    limit=st.integers(1, 20),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=200),
)
def test_never_more_than_the_limit_and_every_slot_comes_back(
    limit: int, ops: list[tuple[bool, int]]
) -> None:
    """Any interleaving of takes and releases: the count is exactly the slots of the requests
    admitted and not yet released, never above the limit, and back to none at the end."""
    algo = Concurrency(limit)
    state: int | None = None
    holding: list[int] = []  # costs of the admitted requests still in flight
    for take, cost in ops:
        if take or not holding:
            decision, new_state = algo.decide(state, NOW, cost)
            assert decision.allowed == (sum(holding) + cost <= limit)
            if decision.allowed:
                holding.append(cost)
                state = new_state
            else:
                assert new_state == state
        else:
            released = holding.pop(0)
            assert state is not None
            state = algo.refund(state, NOW, released)
        assert (state or 0) == sum(holding) <= limit
    for cost in holding:
        assert state is not None
        state = algo.refund(state, NOW, cost)
    assert not holding or state == 0


def test_it_pickles_by_its_parameters() -> None:
    """The shared store records each limit's algorithm pickled; compiled, a class without
    ``__reduce__`` cannot be made again (every worker of ``--workers N`` failed to start)."""
    algorithm = Concurrency(3, 2.0)
    assert pickle.loads(pickle.dumps(algorithm)) == algorithm
