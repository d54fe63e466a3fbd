"""What ``gateway run`` builds from a policy before it opens a socket, built for nothing else.

``gateway check``, ``gateway run`` and a reload all load a policy through the loader, which ends
here: the store the policy names (the environment's ``GATEWAY_STORE_URL`` included), every limit's
algorithm and that store's plan for it. So a limit the Redis store cannot run, say, fails ``check``
with its file and line rather than ``run`` with a traceback. Nothing connects: the store clients
open their connections on first use.
"""

from __future__ import annotations

from gateway.algorithms.registry import build_algorithm
from gateway.engine import LimitEngine
from gateway.policy import Policy
from gateway.redact import redact_text
from gateway.stores import build_store

Loc = tuple[str | int, ...]


def build_problems(policy: Policy, workers: int | None = None) -> list[tuple[Loc, str]]:
    """Build the store and the limit engine as ``run`` does; each refusal with its place."""
    workers = workers or policy.server.workers
    try:
        store = build_store(policy.store, workers=workers)
    except ValueError as exc:  # it may quote the store URL, password and all
        return [(("store",), redact_text(str(exc)))]
    engine = LimitEngine(policy, store, build_algorithm)  # the loader checked each algorithm
    problems: list[tuple[Loc, str]] = []
    for limit in engine.limits:
        try:
            store.configure([limit], ())
        except ValueError as exc:
            problems.append((("limits", limit.name), str(exc)))
    if not problems:
        try:
            store.configure(engine.limits, ())
        except ValueError as exc:
            problems.append((("limits",), str(exc)))
    return problems
