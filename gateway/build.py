"""Which build is running: the request path compiled to C with mypyc, or pure Python.

``pip install .`` compiles the modules listed here with mypyc when a C compiler is present (the
same typed source, built as mypy and black ship theirs); ``GATEWAY_PURE_PYTHON=1`` at install
time, or no compiler, installs the pure-Python package. Both decide bit for bit alike. This list
is the one place the build (``setup.py``), ``gateway --version`` and the tests read it from.
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Final

# Set to 1 when installing for a pure-Python build (read by setup.py, not at run time).
PURE_PYTHON_ENV: Final = "GATEWAY_PURE_PYTHON"

# Everything a proxied request runs in gateway/, bottom up. Async generators and subclasses of
# aiohttp or builtin classes live in small interpreted modules (or are non-native classes).
COMPILED_MODULES: Final = (
    "gateway.clock",
    "gateway.histogram",
    "gateway.log_throttle",
    "gateway.algorithms.base",
    "gateway.algorithms.combine",
    "gateway.algorithms.leaky_bucket",
    "gateway.algorithms.fixed_window",
    "gateway.algorithms.sliding_window",
    "gateway.algorithms.sliding_log",
    "gateway.algorithms.token_bucket",
    "gateway.algorithms.concurrency",
    "gateway.algorithms.gradient_limit",
    "gateway.algorithms.calendar_period",
    "gateway.algorithms.calendar_window",
    "gateway.algorithms.charging",
    "gateway.algorithms.registry",
    "gateway.limits.addresses",
    "gateway.limits.response_charge",
    "gateway.limits.usage",
    "gateway.limits.compiled",
    "gateway.limits.keys",
    "gateway.limits.routing",
    "gateway.policy.overrides",
    "gateway.stores.store_stats",
    "gateway.stores.immediate",
    "gateway.stores.keyed_state",
    "gateway.stores.slot_table",
    "gateway.stores.memory",
    "gateway.stores.shared.records",
    "gateway.stores.shared.tables",
    "gateway.stores.shared.worker_lease",
    "gateway.stores.shared.lmdb_store",
    "gateway.stores.redis.codecs",
    "gateway.stores.redis.key_layout",
    "gateway.stores.redis.shadow",
    "gateway.stores.redis.lease",
    "gateway.stores.redis.store",
    "gateway.engine.delay_queue",
    "gateway.engine.limit_engine",
    "gateway.edge.forwarding",
    "gateway.edge.responses",
    "gateway.edge.client_ip",
    "gateway.edge.annotations",
    "gateway.edge.response_usage",
    "gateway.edge.runtime",
    "gateway.edge.upstream_client",
    "gateway.edge.adaptive_gate",
    "gateway.edge.upstream_failures",
    "gateway.edge.pool.balancers",
    "gateway.edge.pool.passive_health",
    "gateway.edge.pool.outliers",
    "gateway.edge.pool.server_pool",
    "gateway.edge.next_upstream",
    "gateway.edge.request_loop",
    "gateway.edge.server",
    "gateway.edge.request_record",
    "gateway.edge.proxy",
    "gateway.observability.stats",
    "gateway.observability.worker",
    "gateway.observability.access_log",
    "gateway.observability.log_file",
    # ``gateway replay``: reading the log and deciding each line, a million lines a run.
    "gateway.replay.log_formats",
    "gateway.replay.simulate",
    "gateway.replay.run",
)


def _is_extension(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(EXTENSION_SUFFIXES))


def compiled_modules() -> list[str]:
    """The listed modules that load from a C extension (found, not imported)."""
    return [module for module in COMPILED_MODULES if _is_extension(module)]


def build_name() -> str:
    """``compiled``, ``pure Python``, or, for a mixed tree, which modules are compiled."""
    compiled = compiled_modules()
    if len(compiled) == len(COMPILED_MODULES):
        return "compiled"
    if not compiled:
        return "pure Python"
    return f"partly compiled ({len(compiled)} of {len(COMPILED_MODULES)} modules)"
