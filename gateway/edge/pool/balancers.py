"""Which server of a pool takes a request: pure, given the servers that may.

Each balancer is built for the pool's weights and asked ``pick(candidates, inflight, key)``:
``candidates`` the indexes (ascending, never empty) of the servers available now, ``inflight``
each server's requests in flight, ``key`` the request's hash key (``balance: hash`` only).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Final, Protocol

# Points per unit of weight on the hash ring (nginx's ``hash ... consistent``, as ketama).
RING_POINTS_PER_WEIGHT: Final = 160


class Balancer(Protocol):
    def pick(self, candidates: Sequence[int], inflight: Sequence[int], key: str) -> int: ...


class RoundRobin:
    """nginx's smooth weighted round robin: each pick, every candidate's current weight grows by
    its weight and the largest is chosen and lowered by their sum. Each candidate gets exactly
    its weight per cycle and, over any run of picks among the same candidates, its share within
    about one pick (nginx's order strays up to 1.06 picks at weights 1, 1, 1, 5, 5, 5, 1.08 at
    1, 1, 1, 7, 7, 7: never 1.5 for weights up to 10), spread out rather than in bursts
    (weights 5, 1, 1 give a a b a c a a, not a a a a a b c)."""

    __slots__ = ("_current", "_weights")

    def __init__(self, weights: Sequence[int]) -> None:
        self._weights = tuple(weights)
        self._current = [0] * len(self._weights)

    def pick(self, candidates: Sequence[int], inflight: Sequence[int], key: str) -> int:
        current = self._current
        weights = self._weights
        total = 0
        best = -1
        best_weight = 0
        for index in candidates:
            weight = weights[index]
            grown = current[index] + weight
            current[index] = grown
            total += weight
            if best < 0 or grown > best_weight:
                best = index
                best_weight = grown
        current[best] -= total
        return best


class LeastInflight:
    """The candidate with the fewest requests in flight for its weight (nginx's
    ``least_conn``); ties go round robin, so an idle pool still spreads by weight."""

    __slots__ = ("_tie_break", "_weights")

    def __init__(self, weights: Sequence[int]) -> None:
        self._weights = tuple(weights)
        self._tie_break = RoundRobin(self._weights)

    def pick(self, candidates: Sequence[int], inflight: Sequence[int], key: str) -> int:
        weights = self._weights
        fewest: list[int] = []
        best_load = 0
        best_weight = 1
        for index in candidates:
            load = inflight[index]
            weight = weights[index]
            if not fewest:
                fewest.append(index)
                best_load, best_weight = load, weight
                continue
            # load / weight compared without division
            left = load * best_weight
            right = best_load * weight
            if left < right:
                fewest = [index]
                best_load, best_weight = load, weight
            elif left == right:
                fewest.append(index)
        if len(fewest) == 1:
            return fewest[0]
        return self._tie_break.pick(fewest, inflight, key)


def ring_hash(text: str) -> int:
    """A stable 32-bit hash (never Python's ``hash``: it differs between processes)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=4).digest()
    return int.from_bytes(digest, "big")


class ConsistentHash:
    """A hash ring with ``RING_POINTS_PER_WEIGHT`` points per unit of a server's weight, each
    placed by the server's identity alone: a server that leaves takes only its own arcs with it,
    so only its keys (about 1/N of them) move, each to the next server on the ring. A key whose
    server is unavailable goes on clockwise to the first candidate."""

    __slots__ = ("_owners", "_points")

    def __init__(self, identities: Sequence[str], weights: Sequence[int]) -> None:
        ring: list[tuple[int, int]] = []
        for index, (identity, weight) in enumerate(zip(identities, weights, strict=True)):
            for point in range(weight * RING_POINTS_PER_WEIGHT):
                ring.append((ring_hash(f"{identity}#{point}"), index))
        ring.sort()
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def pick(self, candidates: Sequence[int], inflight: Sequence[int], key: str) -> int:
        points = self._points
        owners = self._owners
        size = len(points)
        start = bisect.bisect_left(points, ring_hash(key))
        allowed = candidates if len(candidates) < 8 else frozenset(candidates)
        for step in range(size):
            owner = owners[(start + step) % size]
            if owner in allowed:
                return owner
        return candidates[0]
