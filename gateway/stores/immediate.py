"""The stores that decide every request without waiting (in process, the shared store), as one
native base class the engine calls on the request path.

Compiled, a call through a protocol (``DecidesNow`` was one) is a Python method call: the
method looked up by name, the arguments packed and parsed again, some 550 instructions a
request; one through this class is a C call through its method table (bench/README.md,
"Fourth round").
"""

from __future__ import annotations

from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from gateway.algorithms.combine import CombinedDecision
from gateway.limits.compiled import Check


# Interpreted subclasses allowed: the shared store allows them (a test overrides a step).
@mypyc_attr(allow_interpreted_subclasses=True)
class DecidesNow:
    """A store that decides every request without waiting: the engine calls ``decide_now``
    directly, with no coroutine per request. Each method is the coroutine of ``LimitStore``
    of the same name without ``_now``, done rather than awaited."""

    def decide_now(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        """``decide``, returned rather than awaited."""
        raise NotImplementedError

    def charge_now(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        """``charge``, returned rather than awaited."""
        raise NotImplementedError

    def refund_now(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """``refund``, done rather than awaited."""
        raise NotImplementedError

    def release(self, checks: Sequence[Check]) -> None:
        """Give back the slots of a request's concurrency checks."""
        raise NotImplementedError
