"""What ``gateway run`` builds from a policy before it opens a socket, built for nothing else.

``gateway check``, ``gateway run``, a reload and a replay load a policy through here: the loader
validates the file, then this builds every limit's algorithm, the store the policy names (the
environment's ``GATEWAY_STORE_URL`` included) and that store's plan for each limit. So a limit
the Redis store cannot run, say, fails ``check`` with its file and line rather than ``run`` with
a traceback. Nothing connects: the store clients open their connections on first use.
"""

from __future__ import annotations

from pathlib import Path

from gateway.algorithms.registry import build_algorithm
from gateway.engine.limit_engine import LimitEngine
from gateway.policy.loader import BuildChecks, LoadedPolicy, Loc, load_policy, parse_policy
from gateway.policy.models import Policy
from gateway.policy.tls_files import TlsFilesError, listener_tls_loc, load_tls
from gateway.redact import redact_text
from gateway.stores import build_store


def algorithm_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """Parameters an algorithm refuses, each at its limit."""
    problems: list[tuple[Loc, str]] = []
    for name, limit in policy.limits.items():
        try:
            build_algorithm(limit)
        except (TypeError, ValueError) as exc:  # TypeError: a value of the wrong type
            problems.append((("limits", name), str(exc)))
    return problems


def build_problems(policy: Policy, workers: int | None = None) -> list[tuple[Loc, str]]:
    """Build the algorithms, the store and the limit engine as ``run`` does; each refusal with
    its place."""
    problems = algorithm_problems(policy)
    if problems:
        return problems
    workers = workers or policy.server.workers
    try:
        store = build_store(policy.store, workers=workers)
    except ValueError as exc:  # it may quote the store URL, password and all
        return [(("store",), redact_text(str(exc)))]
    engine = LimitEngine(policy, store, build_algorithm)
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


def tls_problems(policy: Policy, policy_file: str) -> list[tuple[Loc, str]]:
    """Each TLS listener's certificates and keys, loaded as ``run`` loads them."""
    problems: list[tuple[Loc, str]] = []
    for index, listener in enumerate(policy.server.listeners):
        if listener.tls is None:
            continue
        try:
            load_tls(listener.tls, policy_file)
        except TlsFilesError as exc:
            problems.append((listener_tls_loc(policy.server, index, exc.index), str(exc)))
    return problems


def load_and_build(
    path: str | Path, workers: int | None = None, also: BuildChecks | None = None
) -> LoadedPolicy:
    """Load a policy file and refuse it, with its lines, if ``run`` could not build it (or,
    given ``also``, if that check names a problem: ``check`` binds the listeners)."""

    def problems(policy: Policy) -> list[tuple[Loc, str]]:
        found = build_problems(policy, workers) or tls_problems(policy, str(path))
        return found or (also(policy) if also is not None else [])

    return load_policy(path, problems)


def parse_and_build(text: str, file: str = "<policy>") -> LoadedPolicy:
    """``load_and_build`` for policy text."""
    return parse_policy(text, file, lambda p: build_problems(p) or tls_problems(p, file))
