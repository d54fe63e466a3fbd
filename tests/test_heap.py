"""The start-up heap frozen out of the collector's reach, and thawed once per reload."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gateway.serving.heap import SERVING_YOUNG_THRESHOLD, freeze_startup_heap, refreeze_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    threshold = gc.get_threshold()
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def _young_collections_serving(requests: int, in_flight: int) -> int:
    """Young collections while ``requests`` requests pass, arriving and finishing in waves of up
    to ``in_flight`` (as a busy event loop reads a batch of requests, then finishes them), each
    making a few dozen tracked objects that all die by reference counting when it ends (as a
    proxied request's do): no garbage for the collector at all."""
    passes = 0

    def count(phase: str, info: dict[str, int]) -> None:
        nonlocal passes
        if phase == "start" and info["generation"] == 0:
            passes += 1

    window: list[list[object]] = []
    gc.callbacks.append(count)
    try:
        for _ in range(requests):
            window.append([Node() for _node in range(32)])
            if len(window) == in_flight:
                window.clear()
    finally:
        gc.callbacks.remove(count)
    return passes


def _cycle() -> weakref.ref[Node]:
    """A reference cycle only the collector frees, known by a weak reference."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_garbage_frozen_with_a_retired_runtime_is_freed_by_refreeze(frozen_heap: None) -> None:
    gc.unfreeze()
    alive = _cycle()  # made while serving, then frozen with the heap, then dropped
    gc.freeze()
    gc.collect()
    assert alive() is not None  # a frozen cycle is out of the collector's reach
    refreeze_heap()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # and the rest is frozen again


def test_refreeze_changes_nothing_where_nothing_was_frozen() -> None:
    assert gc.get_freeze_count() == 0
    refreeze_heap()
    assert gc.get_freeze_count() == 0


def test_serving_churn_runs_no_young_collections(frozen_heap: None) -> None:
    assert gc.get_threshold()[0] == SERVING_YOUNG_THRESHOLD
    assert _young_collections_serving(20_000, in_flight=64) == 0


def test_requests_run_hundreds_of_young_collections_at_the_default_threshold() -> None:
    """What the serving threshold is for: at CPython's default, the count is a ratchet."""
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        assert _young_collections_serving(20_000, in_flight=64) > 100
    finally:
        gc.set_threshold(*threshold)


def test_real_cyclic_garbage_is_still_collected_while_serving(frozen_heap: None) -> None:
    refs = [_cycle() for _ in range(SERVING_YOUNG_THRESHOLD)]
    assert sum(ref() is not None for ref in refs) < SERVING_YOUNG_THRESHOLD // 2
