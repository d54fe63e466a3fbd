"""The start-up heap frozen out of the collector's reach, and thawed once per reload."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gateway.heap import freeze_startup_heap, refreeze_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()


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
