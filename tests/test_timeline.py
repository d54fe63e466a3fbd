"""The dashboard's history: per-second rates between whole-gateway snapshots."""

from __future__ import annotations

from gateway.observability.snapshot import GatewaySnapshot, LimitData, StoreData
from gateway.observability.timeline import Timeline


def _snapshot(at: float, requests: int, rejected: int) -> GatewaySnapshot:
    return GatewaySnapshot(
        at=at,
        workers=1,
        worker_ids=(0,),
        policy_sha256=("0" * 64,),
        policy_source="policy.yaml",
        policy_loaded_at=0.0,
        requests=(("all", "2xx", 200, requests - rejected), ("all", "4xx", 429, rejected)),
        durations={},
        upstream_errors=(),
        limited_requests=rejected,
        limits={
            "per_ip": LimitData(
                algorithm="fixed_window",
                dry_run=False,
                allowed=requests - rejected,
                rejected=rejected,
            )
        },
        top_keys={},
        store_name="memory",
        store_states={"ok": 1},
        store=StoreData(name="memory"),
        reload=None,
        connections_open=0,
        connections_refused=0,
        header_timeouts=0,
    )


def test_the_first_tick_just_after_start_up_makes_no_point_of_a_few_milliseconds() -> None:
    """Started 20 ms before a whole second: the first tick's rates would be over 20 ms, 0.0
    whatever the traffic; the first point is over the whole time since start-up instead."""
    timeline = Timeline()
    assert timeline.add(_snapshot(100.98, 0, 0)) is None  # primes
    assert timeline.add(_snapshot(101.0, 0, 0)) is None  # 20 ms: no point
    point = timeline.add(_snapshot(102.0, 51, 10))
    assert point is not None
    assert point["dt"] == 1.02
    assert (point["requests"], point["rejected"]) == (50.0, round(10 / 1.02, 3))
    assert point["limits"]["per_ip"]["rejected"] == round(10 / 1.02, 3)
    assert list(timeline.points) == [point]
    # From then on, one point a tick.
    assert timeline.add(_snapshot(103.0, 61, 10)) == {**timeline.points[-1]}
    assert len(timeline.points) == 2


def test_a_wall_clock_stepped_back_starts_afresh_rather_than_stalling() -> None:
    timeline = Timeline()
    timeline.add(_snapshot(100.0, 0, 0))
    assert timeline.add(_snapshot(50.0, 5, 0)) is None
    point = timeline.add(_snapshot(51.0, 7, 0))
    assert point is not None and point["requests"] == 2.0
