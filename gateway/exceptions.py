"""Exception chaining that survives compilation: mypyc 2.4 drops the cause of
``raise error from cause`` (``__cause__`` stays None), and the upstream failure log reads it to
tell a refused connection from a certificate the upstream's CA did not sign."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def caused_by(error: E, cause: BaseException) -> E:
    """``error`` with ``cause`` as its ``__cause__``: ``raise caused_by(error, cause)``."""
    error.__cause__ = cause
    return error
