"""Where limit state lives: the store protocol, the in-process store, the Redis store, and
the factory that picks one from the policy's store URL."""

from __future__ import annotations

import os

from gateway.clock import Clock
from gateway.policy.models import StoreSettings
from gateway.stores.memory import MemoryStore
from gateway.stores.protocol import LimitStore, StoreUnavailableError
from gateway.stores.redis import RedisStore
from gateway.stores.shared.lmdb_store import SharedStore
from gateway.stores.shared.runtime_dir import worker_runtime_dir

__all__ = [
    "STORE_URL_ENV",
    "LimitStore",
    "MemoryStore",
    "RedisStore",
    "SharedStore",
    "StoreUnavailableError",
    "build_store",
    "shared_store_selected",
    "store_url",
]


STORE_URL_ENV = "GATEWAY_STORE_URL"


def store_url(settings: StoreSettings) -> str:
    """The store URL in force: the environment's ``GATEWAY_STORE_URL`` over the policy's."""
    return os.environ.get(STORE_URL_ENV) or settings.url


def shared_store_selected(settings: StoreSettings, workers: int) -> bool:
    """``shared``, or in-process state with several workers: they share one state then."""
    url = store_url(settings)
    return url == "shared" or (url == "memory" and workers > 1)


def build_store(
    settings: StoreSettings,
    clock: Clock | None = None,
    workers: int = 1,
    *,
    open_shared: bool = False,
    worker_id: int = 0,
) -> LimitStore:
    """The store a policy names.

    ``store.replicas`` counts gateway instances; each of an instance's ``workers`` processes
    falls back to its own in-process limits, so the ``local`` fallback divides by both.
    The shared store opens its runtime directory with ``open_shared`` (a worker), not when
    built to be checked.
    """
    url = store_url(settings)
    if shared_store_selected(settings, workers):
        shared_dir = worker_runtime_dir(workers) if open_shared else None
        lease = settings.worker_lease
        return SharedStore(
            shared_dir,
            clock,
            reports_counts=worker_id == 0,
            workers=workers,
            on_failure=settings.on_failure,
            worker_id=worker_id,
            lease_units=lease.units if lease is not None else 0,
            lease_interval_s=lease.interval if lease is not None else 0.0,
        )
    if url == "memory":
        return MemoryStore(clock)
    return RedisStore(
        url,
        on_failure=settings.on_failure,
        replicas=settings.replicas * workers,
        timeout_s=settings.timeout,
        key_prefix=settings.key_prefix,
        client=settings.client,
        clock=clock,
        slot_ttl_s=settings.slot_ttl,
    )
