"""The pool's pure parts: balancers, nginx's passive health, Envoy's outlier ejection, active
check verdicts; each driven by hand-given times, the balancers' invariants by hypothesis."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.edge.pool.active_health import ActiveHealth
from gateway.edge.pool.balancers import ConsistentHash, LeastInflight, RoundRobin
from gateway.edge.pool.outliers import OutlierDetector
from gateway.edge.pool.passive_health import PassiveHealth
from gateway.policy.models import OutlierDetection

weights_st = st.lists(st.integers(1, 10), min_size=1, max_size=6)


@given(weights_st, st.integers(1, 5))
def test_round_robin_gives_each_server_exactly_its_weight_per_cycle(
    weights: list[int], cycles: int
) -> None:
    balancer = RoundRobin(weights)
    everyone = list(range(len(weights)))
    picks = Counter(balancer.pick(everyone, (), "") for _ in range(sum(weights) * cycles))
    assert [picks[i] for i in everyone] == [w * cycles for w in weights]


@given(weights_st, st.integers(0, 200))
def test_round_robin_is_smooth_at_every_prefix(weights: list[int], length: int) -> None:
    """After any number of picks, each server is within about one pick of its exact share:
    under 1.5 (nginx's smooth order itself strays past one pick: the test below)."""
    assert _most_astray(weights, length) < 1.5


def _most_astray(weights: list[int], length: int) -> float:
    """How far any server strays from its exact share over the first ``length`` picks."""
    balancer = RoundRobin(weights)
    everyone = list(range(len(weights)))
    picks: Counter[int] = Counter()
    total = sum(weights)
    most = 0.0
    for n in range(1, length + 1):
        picks[balancer.pick(everyone, (), "")] += 1
        for i, weight in enumerate(weights):
            most = max(most, abs(picks[i] - n * weight / total))
    return most


def test_round_robin_strays_past_one_pick_where_nginx_does() -> None:
    """Weights 1, 1, 1, 5, 5, 5: after 11 picks nginx's smooth order has given the last server
    2 of its 3.06 (worked by hand from nginx's rule); the bound above is not "within one pick",
    which a CI run's random weights found false of nginx's algorithm."""
    balancer = RoundRobin([1, 1, 1, 5, 5, 5])
    order = [balancer.pick(list(range(6)), (), "") for _ in range(18)]
    assert order == [3, 4, 5, 0, 3, 4, 5, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5]
    assert 1.05 < _most_astray([1, 1, 1, 5, 5, 5], 18) < 1.06


def test_round_robin_interleaves_a_heavy_server() -> None:
    balancer = RoundRobin([5, 1, 1])
    order = "".join("abc"[balancer.pick([0, 1, 2], (), "")] for _ in range(7))
    assert order == "aabacaa"


@given(weights_st, st.data())
def test_round_robin_picks_only_candidates(weights: list[int], data: st.DataObject) -> None:
    balancer = RoundRobin(weights)
    for _ in range(20):
        candidates = sorted(
            data.draw(st.sets(st.integers(0, len(weights) - 1), min_size=1), label="candidates")
        )
        assert balancer.pick(candidates, (), "") in candidates


@given(weights_st, st.data())
def test_least_inflight_picks_a_least_loaded_candidate(
    weights: list[int], data: st.DataObject
) -> None:
    balancer = LeastInflight(weights)
    size = len(weights)
    for _ in range(20):
        inflight = data.draw(st.lists(st.integers(0, 50), min_size=size, max_size=size))
        candidates = sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1)))
        chosen = balancer.pick(candidates, inflight, "")
        assert chosen in candidates
        best = min(inflight[i] / weights[i] for i in candidates)
        assert inflight[chosen] / weights[chosen] == best


def test_least_inflight_spreads_ties_by_weight() -> None:
    balancer = LeastInflight([2, 1])
    picks = Counter(balancer.pick([0, 1], [0, 0], "") for _ in range(300))
    assert picks == {0: 200, 1: 100}


identities_st = st.lists(
    st.text("abcdefghij0123456789.:", min_size=1, max_size=12), min_size=2, max_size=6, unique=True
)
keys = [f"client-{n}" for n in range(2000)]


@settings(max_examples=25, deadline=None)
@given(identities_st)
def test_consistent_hash_moves_only_the_keys_of_a_server_that_leaves(
    identities: list[str],
) -> None:
    weights = [1] * len(identities)
    ring = ConsistentHash(identities, weights)
    everyone = list(range(len(identities)))
    before = {key: identities[ring.pick(everyone, (), key)] for key in keys}
    leaving = identities[0]
    rest = identities[1:]
    smaller = ConsistentHash(rest, weights[1:])
    after = {key: rest[smaller.pick(list(range(len(rest))), (), key)] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == leaving for key in moved)
    assert len(moved) == sum(1 for key in keys if before[key] == leaving)
    # A server down for a while (not removed): its keys go where they would if it left.
    around = {key: identities[ring.pick(everyone[1:], (), key)] for key in keys}
    assert around == after


def test_consistent_hash_shares_keys_about_evenly_and_keeps_each_key() -> None:
    ring = ConsistentHash(["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"], [1] * 4)
    owners = Counter(ring.pick([0, 1, 2, 3], (), key) for key in keys)
    assert all(350 < owners[i] < 650 for i in range(4)), owners  # 500 each, give or take
    assert all(ring.pick([0, 1, 2, 3], (), key) == ring.pick([0, 1, 2, 3], (), key) for key in keys)


# -- passive health, as ngx_http_upstream_round_robin.c -------------------------------------------


def test_max_fails_within_fail_timeout_takes_a_server_out_then_one_trial() -> None:
    health = PassiveHealth(max_fails=3, fail_timeout_s=10.0)
    assert not health.failed(100.0)
    health.succeeded()  # a success right after a failure does not clear the count
    assert not health.failed(101.0)
    assert health.failed(102.0)  # the third within fail_timeout
    assert not health.available(102.0)
    assert not health.available(112.0)  # exactly fail_timeout after the last check: still out
    assert health.available(112.5)
    health.picked(112.5)  # the trial: it stamps the check time ...
    assert not health.available(112.6)  # ... so nobody else is sent meanwhile
    assert health.succeeded()  # the trial worked: back, count cleared
    assert health.available(112.7) and health.fails == 0


def test_a_failed_trial_takes_the_server_out_for_another_fail_timeout() -> None:
    health = PassiveHealth(max_fails=1, fail_timeout_s=5.0)
    assert health.failed(0.0)
    health.picked(6.0)
    assert not health.failed(6.0)  # already out: not a new "taken out"
    assert not health.available(10.0)
    assert health.available(11.5)


def test_failures_far_apart_are_cleared_by_a_success_after_a_check() -> None:
    health = PassiveHealth(max_fails=2, fail_timeout_s=10.0)
    health.failed(0.0)
    health.picked(20.0)  # picked long after: the check time moves on
    assert not health.succeeded()  # it was not out: nothing came back
    assert health.fails == 0
    assert not health.failed(21.0)  # one failure again, not two
    assert health.available(21.0)


def test_max_fails_zero_never_takes_a_server_out() -> None:
    health = PassiveHealth(max_fails=0, fail_timeout_s=10.0)
    for t in range(100):
        health.failed(float(t))
    assert health.available(100.0)


# -- outlier ejection --------------------------------------------------------------------------


def _detector(size: int, **settings_: object) -> OutlierDetector:
    return OutlierDetector(OutlierDetection.model_validate(settings_), size, now=0.0)


def _interval(
    detector: OutlierDetector, answers: list[tuple[int, float, float]], now: float
) -> list[int]:
    """Each server's (answers, failure share, latency) over one interval; who was ejected."""
    for index, (count, share, latency) in enumerate(answers):
        failures = round(count * share)
        for n in range(count):
            detector.record(index, n < failures, latency)
    return [e.index for e in detector.evaluate(now)]


def test_a_server_failing_half_its_requests_is_ejected_for_a_growing_time() -> None:
    detector = _detector(3, interval="10s", base_ejection_time="30s")
    assert _interval(detector, [(40, 0.0, 0.01), (40, 0.5, 0.01), (40, 0.0, 0.01)], 10.0) == [1]
    assert detector.ejected(1, 39.9) and not detector.ejected(1, 40.0)
    # Back, and still failing: ejected again, twice as long.
    assert _interval(detector, [(40, 0.0, 0.01), (40, 0.5, 0.01), (40, 0.0, 0.01)], 40.0) == [1]
    assert detector.ejected(1, 99.9) and not detector.ejected(1, 100.0)


def test_a_problem_every_server_shares_ejects_nobody() -> None:
    detector = _detector(3)
    assert _interval(detector, [(40, 0.5, 0.01), (40, 0.6, 0.01), (40, 0.5, 0.01)], 10.0) == []


def test_a_slow_server_is_ejected_by_latency() -> None:
    detector = _detector(3, latency_factor=5)
    assert _interval(detector, [(40, 0, 0.02), (40, 0, 0.2), (40, 0, 0.021)], 10.0) == [1]


def test_fast_jitter_below_min_latency_ejects_nobody() -> None:
    detector = _detector(2, latency_factor=5, min_latency="10ms")
    assert _interval(detector, [(40, 0, 0.0002), (40, 0, 0.005)], 10.0) == []


def test_too_few_answers_are_not_judged() -> None:
    detector = _detector(2, min_requests=10)
    assert _interval(detector, [(9, 1.0, 0.01), (40, 0.0, 0.01)], 10.0) == []


@given(st.integers(2, 12), st.integers(0, 100), st.data())
def test_never_more_than_max_ejection_percent_of_the_pool(
    size: int, percent: int, data: st.DataObject
) -> None:
    detector = _detector(size, max_ejection_percent=percent, interval="1s")
    allowed = 0 if percent == 0 else max(1, size * percent // 100)
    for round_ in range(1, 6):
        shares = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size))
        _interval(detector, [(20, share, 0.01) for share in shares], float(round_))
        assert sum(detector.ejected(i, float(round_)) for i in range(size)) <= allowed


def test_active_checks_need_their_counts_in_a_row() -> None:
    health = ActiveHealth(healthy_after=2, unhealthy_after=3)
    assert [health.record(False) for _ in range(3)] == [False, False, True]
    assert not health.healthy
    assert not health.record(True)
    assert not health.record(False)  # the run of passes starts again
    assert [health.record(True), health.record(True)] == [False, True]
    assert health.healthy
