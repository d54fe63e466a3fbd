"""The per-limit table of per-key states: bounded like an nginx zone, idle keys expired as we go.

A table holds at most ``max_keys`` keys. Reading a key (``get``) makes it the most recently
used; adding a key to a full table evicts the least recently used one, whatever its state (a
client that comes back starts afresh, as with a full nginx zone). Keys whose state has decayed
to what a fresh key would have (``Algorithm.is_idle``) are dropped without changing any
decision: up to two of the least recently used on every new key (nginx's
``ngx_http_limit_req_expire``), and as many as asked by ``sweep``. Every operation does a
bounded amount of work; only a policy reload (``rescale``) visits every key.

An ``OrderedDict``, not a plain dict with pop-and-reinsert: both keep LRU order, but a plain
dict leaves a hole in its entry array for every key moved or removed, and finding the oldest key
(``next(iter(d))``) walks over every hole at the front until the next resize. Measured with
``python bench/bench_algorithms.py --lru`` on 1,000,000 IPv4 keys (shared machine, latencies
noisy): a full plain-dict table took 0.25-0.5 ms per new key and 24-27 us per lookup once
churned; evicting 1/1024 of it at once amortises the walk (2-3 us) but stalls for milliseconds
per batch and evicts early. The ordered dict's linked list costs memory instead: 176 bytes per
key filled (plain dict: 127), about 245 once churn has made CPython double the hash table
(plain dict: about 180), for O(1) ``get``, ``put``, eviction and expiry (1.5 us a lookup or a
new key).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Final, Generic, TypeVar

from gateway.algorithms.base import Algorithm

S = TypeVar("S")

# Idle keys looked at, oldest first, each time a new key is added (nginx expires up to 2).
EXPIRE_ON_INSERT: Final = 2


class KeyedState(Generic[S]):
    """``key -> state`` for one limit, at most ``max_keys`` keys, least recently used evicted."""

    __slots__ = ("_states", "algorithm", "evictions", "expiries", "max_keys")

    def __init__(self, max_keys: int, algorithm: Algorithm[S]) -> None:
        self.max_keys = _check_max_keys(max_keys)
        self.algorithm = algorithm
        self._states: OrderedDict[str, S] = OrderedDict()
        self.evictions = 0  # keys dropped to make room while their state still mattered
        self.expiries = 0  # keys dropped because their state had decayed to nothing

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def __iter__(self) -> Iterator[str]:
        """Keys from least to most recently used."""
        return iter(self._states)

    def get(self, key: str) -> S | None:
        """The key's state (``None`` if not tracked), marking the key most recently used."""
        states = self._states
        state = states.get(key)
        if state is not None:
            states.move_to_end(key)
        return state

    def peek(self, key: str) -> S | None:
        """The key's state without touching its place in the LRU order (for inspection)."""
        return self._states.get(key)

    def put(self, key: str, state: S | None, now_us: int | None = None) -> None:
        """Store the key's state as the most recently used; ``None`` forgets the key.

        A new key first lets idle keys expire (when ``now_us`` is given), then evicts the least
        recently used key if the table is still full.
        """
        states = self._states
        if state is None:
            states.pop(key, None)
            return
        if key in states:
            states[key] = state
            states.move_to_end(key)
            return
        if now_us is not None:
            self.sweep(now_us, EXPIRE_ON_INSERT)
        while len(states) >= self.max_keys:
            states.popitem(last=False)
            self.evictions += 1
        states[key] = state

    def discard(self, key: str) -> None:
        self._states.pop(key, None)

    def sweep(self, now_us: int, budget: int) -> int:
        """Drop idle keys, least recently used first, looking at ``budget`` keys at most and
        stopping at the first that is not idle; returns how many were dropped.

        The least recently used key has been idle longest; keys behind a busy one are left for
        a later sweep (or eviction), which keeps the work per call bounded.
        """
        states = self._states
        is_idle = self.algorithm.is_idle
        dropped = 0
        while dropped < budget and states:
            key = next(iter(states))
            if not is_idle(states[key], now_us):
                break
            del states[key]
            dropped += 1
        self.expiries += dropped
        return dropped

    def resize(self, max_keys: int) -> None:
        """Change the bound; a smaller one evicts the least recently used keys at once."""
        self.max_keys = _check_max_keys(max_keys)
        states = self._states
        while len(states) > self.max_keys:
            states.popitem(last=False)
            self.evictions += 1

    def rescale(self, algorithm: Algorithm[S], previous: Algorithm[Any], now_us: int) -> None:
        """Adopt a reloaded limit's algorithm, carrying every key's state over with
        ``algorithm.rescale`` (keys it answers ``None`` for start afresh). Visits every key:
        for reloads, not for the request path."""
        states = self._states
        rescaled: OrderedDict[str, S] = OrderedDict()
        for key, state in states.items():
            new_state = algorithm.rescale(state, previous, now_us)
            if new_state is not None:
                rescaled[key] = new_state
        self._states = rescaled
        self.algorithm = algorithm


def _check_max_keys(max_keys: int) -> int:
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
        raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
    return max_keys
