"""The protocol every limiter algorithm implements, and the one decision value they all return.

Algorithms are pure: ``decide`` takes the key's current state (``None`` for a key never seen or
expired) and ``now_us`` and returns a decision plus the state to commit. Nothing is mutated, so a
caller holding several limits can check them all and then commit only if every one admits the
request (nginx's multi-zone rule), and the Redis Lua scripts can mirror the same arithmetic.
"""

from __future__ import annotations

from typing import Any, Final, Generic, NamedTuple, Protocol, TypeVar

S = TypeVar("S")

US_PER_S = 1_000_000


class Decision(NamedTuple):
    """What one limit says about one request; feeds response headers, metrics and the dashboard.

    ``allowed`` false means reject. When allowed, ``delay_s`` > 0 means the request must wait that
    long before it is forwarded (traffic shaping). ``retry_after_s`` is how long a rejected client
    should wait before a retry can succeed (0 when allowed). ``limit`` and ``remaining`` are in
    requests (cost units) for the current window or bucket; ``reset_s`` is how long until the
    limit's state has fully recovered (quota back to ``limit``).

    A NamedTuple because one is built per limit per request, and it is built in a fraction of
    a frozen dataclass's time (bench/README.md, "Figures behind design choices").
    """

    allowed: bool
    delay_s: float
    retry_after_s: float
    limit: int
    remaining: int
    reset_s: float


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


# ``Decision(...)`` runs the NamedTuple's generated Python ``__new__``, from compiled code as
# from any other (mypyc calls the class); the admission paths build the same tuple in C
# instead: ``build(Decision, (allowed, delay_s, ..., reset_s))``, every field given, in order
# (a store decides several limits per request). Reading fields needs no such trick: compiled,
# ``decision.allowed`` is a tuple item read. ``Final``: compiled, a C static, not a lookup in the
# module's dictionary per decision.
build: Final = tuple.__new__


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
