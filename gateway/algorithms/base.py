"""The protocol every limiter algorithm implements, and the one decision value they all return.

Algorithms are pure: ``decide`` takes the key's current state (``None`` for a key never seen or
expired) and ``now_us`` and returns a decision plus the state to commit. Nothing is mutated, so a
caller holding several limits can check them all and then commit only if every one admits the
request (nginx's multi-zone rule), and the Redis Lua scripts can mirror the same arithmetic.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S")

US_PER_S = 1_000_000


class Decision:
    """What one limit says about one request; feeds response headers, metrics and the dashboard.

    ``allowed`` false means reject. When allowed, ``delay_s`` > 0 means the request must wait that
    long before it is forwarded (traffic shaping). ``retry_after_s`` is how long a rejected client
    should wait before a retry can succeed (0 when allowed). ``limit`` and ``remaining`` are in
    requests (cost units) for the current window or bucket; ``reset_s`` is how long until the
    limit's state has fully recovered (quota back to ``limit``).

    A plain typed class, not a NamedTuple: one is built per limit per request, and compiled it
    is a native record (its fields unboxed in the object, built by a direct C call), where a
    NamedTuple was built through ``tuple.__new__`` (bench/README.md, "Fourth round"). Never
    changed once built; compared field by field.
    """

    __slots__ = ("allowed", "delay_s", "limit", "remaining", "reset_s", "retry_after_s")

    def __init__(
        self,
        allowed: bool,
        delay_s: float,
        retry_after_s: float,
        limit: int,
        remaining: int,
        reset_s: float,
    ) -> None:
        self.allowed = allowed
        self.delay_s = delay_s
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.remaining = remaining
        self.reset_s = reset_s

    def fields(self) -> tuple[bool, float, float, int, int, float]:
        """The six fields in order (what the NamedTuple's items were)."""
        return (
            self.allowed,
            self.delay_s,
            self.retry_after_s,
            self.limit,
            self.remaining,
            self.reset_s,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(self.fields())

    def __repr__(self) -> str:
        return (
            f"Decision(allowed={self.allowed!r}, delay_s={self.delay_s!r}, "
            f"retry_after_s={self.retry_after_s!r}, limit={self.limit!r}, "
            f"remaining={self.remaining!r}, reset_s={self.reset_s!r})"
        )


def require_int(what: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an int: the pure build refuses what the compiled one's
    typed arguments refuse, with the same exception (and takes a bool as the int it is, as the
    compiled build's unboxed ints must)."""
    if not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {value!r}")


def require_number(what: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an int or a float."""
    if not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {value!r}")


class Algorithm(Protocol, Generic[S]):
    """One rate-limit algorithm with frozen parameters; per-key state is passed in and out."""

    @property
    def name(self) -> str:
        """Algorithm name as written in policy files (``leaky_bucket``, ``token_bucket``...)."""
        ...

    def decide(self, state: S | None, now_us: int, cost: int = 1) -> tuple[Decision, S | None]:
        """Decide one request of ``cost`` units at ``now_us``.

        Returns the decision and the state to commit if the request goes ahead. On reject the
        returned state is the input state unchanged (a rejected request is charged nothing).
        """
        ...

    def is_idle(self, state: S, now_us: int) -> bool:
        """True when the state has decayed to what a fresh key would have, so it may be dropped."""
        ...

    def refund(self, state: S, now_us: int, cost: int = 1, *, charged_us: int | None = None) -> S:
        """Give back ``cost`` units charged by an admitted request that never went ahead.

        Used when a queued client disconnects before its delay ends. ``charged_us`` is the
        ``now_us`` of the decision that charged it, when the store knows it: windows need it to
        refund exactly (without it they cannot tell which request to forget and return the state
        unchanged); buckets do not. A refund never lets a key over its limit.
        """
        ...

    def share(self, replicas: int) -> Algorithm[S]:
        """This replica's share when each of ``replicas`` enforces the limit alone (the Redis
        store's ``on_failure: local``): rates and capacities divided, rounded down (never more
        lenient); ``self`` for one replica."""
        ...

    def rescale(self, state: S, previous: Algorithm[S], now_us: int) -> S | None:
        """Carry a key's state over a policy reload that changed this limit's parameters.

        ``previous`` is the algorithm the state was made under. Usage is rescaled proportionally
        (a bucket 40% full stays 40% full); ``None`` means start the key afresh.
        """
        ...


class Decides:
    """The class every algorithm of this package derives from, for its ``decide`` alone.

    Compiled, a call through the ``Algorithm`` protocol is a Python method call (the instant
    boxed, the arguments parsed, the pair returned as a new tuple); one through this class is
    a C call through its method table. The stores' request path calls ``CompiledLimit.decides``
    (this, or ``ByProtocol`` around an algorithm from elsewhere)."""

    __slots__ = ()

    def decide(self, state: Any, now_us: int, cost: int = 1) -> tuple[Decision, Any]:
        raise NotImplementedError


class ByProtocol(Decides):
    """An ``Algorithm`` that does not derive from ``Decides``, decided through the protocol."""

    __slots__ = ("algorithm",)

    def __init__(self, algorithm: Algorithm[Any]) -> None:
        self.algorithm = algorithm

    def decide(self, state: Any, now_us: int, cost: int = 1) -> tuple[Decision, Any]:
        return self.algorithm.decide(state, now_us, cost)
