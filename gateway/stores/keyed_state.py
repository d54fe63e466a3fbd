"""The per-limit table of per-key states: bounded like an nginx zone, idle keys expired as we go.

A table holds at most ``max_keys`` keys, in three generations of plain dicts: ``young`` (keys
used since the last rotation), ``mid`` (used in the generation before, not since) and ``old``
(older). Using a key (``get`` that finds it, or ``put``) moves it into ``young``. When
``young`` reaches ``generation_keys = ceil(max_keys / 2)`` keys the generations rotate: ``old``
(empty by then) is dropped, ``mid`` becomes ``old``, ``young`` becomes ``mid``. A new key in a
full table evicts from ``old`` (last in, first out: ``dict.popitem``), or from ``mid`` once
``old`` is empty; as ``young`` grows, keys left in ``old`` move to ``mid`` (one per use at
most) so that ``old`` is empty at rotation. So nothing is evicted before the table is full
(a client that comes back starts afresh, as with a full nginx zone), and instead of exact LRU
order the guarantee is: **the ``generation_keys`` most recently used keys are always
tracked**; an evicted key has seen at least that many other keys used since its last use
(``mid`` held that many keys, all used after any key of ``old`` was).

Keys whose state has decayed to what a fresh key would have (``Algorithm.is_idle``) are dropped
without changing any decision: up to two on every new key (nginx's
``ngx_http_limit_req_expire``), and as many as asked by ``sweep``, looking at the oldest
generation first and stopping at the first key that is not idle. Every operation does a bounded
amount of work; only a policy reload (``rescale``, and ``resize`` to another bound) visits
every key.

Why not an ``OrderedDict`` (exact LRU, ``move_to_end``): its linked list costs a node per key
on top of the hash table, and once churn has made CPython resize a dict that has seen deletions
to three times its size, it takes more memory per key at the worst point. Here ``young`` only
grows and ``old`` only shrinks (``popitem`` trims trailing holes), and each generation holds at
most half the bound. The price: a key used out of ``mid`` or ``old`` is a pop and an insert,
plus a move, where the ordered dict relinks a node: slower on uniformly random keys over a full
table, as fast on skewed keys. The figures are in bench/README.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any, Final, Generic, TypeVar

from gateway.algorithms.base import Algorithm, require_int

S = TypeVar("S")

# Idle keys looked at, oldest first, each time a new key is added (nginx expires up to 2).
EXPIRE_ON_INSERT: Final = 2
# ``put_at`` without an instant: no idle key is expired (no clock reads this far back).
_NO_INSTANT: Final = -(1 << 60)


class KeyedState(Generic[S]):
    """``key -> state`` for one limit, at most ``max_keys`` keys; the ``generation_keys``
    most recently used are never evicted."""

    __slots__ = (
        "_aside",
        "_mid",
        "_old",
        "_young",
        "algorithm",
        "evictions",
        "expiries",
        "generation_keys",
        "max_keys",
    )

    def __init__(self, max_keys: int, algorithm: Algorithm[S]) -> None:
        self.max_keys = _check_max_keys(max_keys)
        self.generation_keys = (self.max_keys + 1) // 2
        self.algorithm = algorithm
        self._young: dict[str, S] = {}
        self._mid: dict[str, S] = {}
        self._old: dict[str, S] = {}
        # At most one key, logically old's last: the one a sweep found still busy. Putting it
        # back into ``old`` would use up a slot of old's table for every look.
        self._aside: dict[str, S] = {}
        self.evictions = 0  # keys dropped to make room while their state still mattered
        self.expiries = 0  # keys dropped because their state had decayed to nothing

    def __len__(self) -> int:
        return len(self._young) + len(self._mid) + len(self._old) + len(self._aside)

    def __contains__(self, key: object) -> bool:
        return key in self._young or key in self._mid or key in self._old or key in self._aside

    def __iter__(self) -> Iterator[str]:
        """Keys, the oldest generation first."""
        return chain(self._aside, self._old, self._mid, self._young)

    def get(self, key: str) -> S | None:
        """The key's state (``None`` if not tracked), marking the key used."""
        young = self._young
        state = young.get(key)
        if state is not None:
            return state
        # Inlined, as ``_settle`` for the two cases a hit can be: the request path.
        mid = self._mid
        state = mid.pop(key, None)
        if state is not None:
            young[key] = state
            in_young = len(young)
            old = self._old
            if len(old) + len(self._aside) > self.generation_keys - in_young:
                stale_key, stale_state = (self._aside or old).popitem()
                mid[stale_key] = stale_state
        else:
            state = self._old.pop(key, None)
            if state is None:
                if not self._aside:
                    return None
                state = self._aside.pop(key, None)
                if state is None:
                    return None
            young[key] = state  # old shrank as young grew: nothing to evict
            in_young = len(young)
        if in_young >= self.generation_keys:
            self._rotate()
        return state

    def peek(self, key: str) -> S | None:
        """The key's state without marking it used (for inspection)."""
        for states in (self._young, self._mid, self._old, self._aside):
            state = states.get(key)
            if state is not None:
                return state
        return None

    def put(self, key: str, state: S | None, now_us: int | None = None) -> None:
        """Store the key's state, marking it used; ``None`` forgets the key.

        A new key first lets idle keys expire (when ``now_us`` is given), then evicts if the
        table is full.
        """
        self.put_at(key, state, _NO_INSTANT if now_us is None else now_us)

    def put_at(self, key: str, state: S | None, now_us: int) -> None:
        """``put`` with the instant as a plain int (``_NO_INSTANT``: none), the stores'
        request path: compiled, an ``int | None`` argument is a Python int made per call."""
        if state is None:
            self.discard(key)
            return
        young = self._young
        if key in young:
            young[key] = state
            return
        if (
            self._mid.pop(key, None) is None
            and self._old.pop(key, None) is None
            and (not self._aside or self._aside.pop(key, None) is None)
            and now_us != _NO_INSTANT
        ):
            self.sweep(now_us, EXPIRE_ON_INSERT)
        young[key] = state
        self._settle()

    def discard(self, key: str) -> None:
        for states in (self._young, self._mid, self._old, self._aside):
            if states.pop(key, None) is not None:
                return

    def _settle(self) -> None:
        """After a key joined ``young``: evict so that ``old`` is empty when ``young`` is full
        and the table holds ``max_keys`` at most (one key at most, two if ``max_keys`` is odd),
        and rotate when ``young`` is full."""
        young, mid, old, aside = self._young, self._mid, self._old, self._aside
        excess = len(young) + len(mid) + len(old) + len(aside) - self.max_keys
        while excess > 0:
            (aside or old or mid).popitem()
            self.evictions += 1
            excess -= 1
        room = self.generation_keys - len(young)
        while len(old) + len(aside) > room:
            stale_key, stale_state = (aside or old).popitem()
            mid[stale_key] = stale_state
        if room <= 0:
            self._rotate()

    def _rotate(self) -> None:
        # ``old`` is empty: dropping it frees its table.
        self._old = self._mid
        self._mid = self._young
        self._young = {}

    def sweep(self, now_us: int, budget: int) -> int:
        """Drop idle keys, oldest generation first, looking at ``budget`` keys at most and
        stopping at the first that is not idle; returns how many were dropped.

        ``old`` is looked at from its end (``popitem``; a busy key is set aside, to be looked
        at first next time). ``mid`` is not looked at: the keys at its end are those most
        likely to have been promoted, leaving holes a look would walk over every time; its
        idle keys are dropped once it is ``old``. Once ``old`` is empty, ``young`` is looked at
        from its end (a quiet table, where ``young`` may hold every key).
        """
        is_idle = self.algorithm.is_idle
        aside, old, young = self._aside, self._old, self._young
        dropped = 0
        while dropped < budget:
            source = aside or old
            if source:
                key, state = source.popitem()
                if not is_idle(state, now_us):
                    aside[key] = state
                    break
            elif young:
                # Look before taking: putting a busy key back would use up a slot of the
                # table. ``young`` has no holes at its end to walk over (only discards make
                # any): it only grows, and ``popitem`` trims.
                key, state = next(reversed(young.items()))
                if not is_idle(state, now_us):
                    break
                young.popitem()
            else:
                break
            dropped += 1
        self.expiries += dropped
        return dropped

    def resize(self, max_keys: int) -> None:
        """Change the bound; a smaller one evicts the oldest generations' keys at once."""
        self.max_keys = _check_max_keys(max_keys)
        generation_keys = (self.max_keys + 1) // 2
        if generation_keys >= self.generation_keys and len(self) <= self.max_keys:
            self.generation_keys = generation_keys  # the invariants of ``_settle`` still hold
            return
        self.generation_keys = generation_keys
        # Oldest first; within a generation, keys leave from the end (as ``popitem`` takes them).
        ordered = list(
            chain(
                self._aside.items(),
                reversed(self._old.items()),
                reversed(self._mid.items()),
                reversed(self._young.items()),
            )
        )
        kept = ordered[max(0, len(ordered) - self.max_keys) :]
        self.evictions += len(ordered) - len(kept)
        # The newest ``generation_keys`` become ``mid``, the others ``old``: the invariants of
        # ``_settle`` hold with ``young`` empty.
        split = max(0, len(kept) - generation_keys)
        self._old = dict(reversed(kept[:split]))
        self._mid = dict(reversed(kept[split:]))
        self._young = {}
        self._aside = {}

    def rescale(self, algorithm: Algorithm[S], previous: Algorithm[Any], now_us: int) -> None:
        """Adopt a reloaded limit's algorithm, carrying every key's state over with
        ``algorithm.rescale`` (keys it answers ``None`` for start afresh). Visits every key:
        for reloads, not for the request path."""

        def rescaled(states: dict[str, S]) -> dict[str, S]:
            carried: dict[str, S] = {}
            for key, state in states.items():
                new_state = algorithm.rescale(state, previous, now_us)
                if new_state is not None:
                    carried[key] = new_state
            return carried

        self._young = rescaled(self._young)
        self._mid = rescaled(self._mid)
        self._old = rescaled(self._old)
        self._aside = rescaled(self._aside)
        self.algorithm = algorithm


def _check_max_keys(max_keys: int) -> int:
    require_int("max_keys", max_keys)
    if max_keys < 1:
        raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
    return max_keys
