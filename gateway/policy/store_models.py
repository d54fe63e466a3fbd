"""``store:``: where the limits' state lives (this process, the workers' shared store, Redis)
and how it is shared."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.policy.model_base import Timeout, _Model
from gateway.redact import redact_url

_STORE_URL_RE = re.compile(r"^(memory|shared|(redis|rediss)(\+cluster)?://\S+)$")


class WorkerLeaseSettings(_Model):
    """Worker leases on the shared store: a worker takes a batch of a hot key's quota in one
    shared write and decides the key's next requests from it alone
    (``gateway/stores/shared/worker_lease.py`` states each algorithm's bound)."""

    units: int = Field(
        64,
        ge=2,
        le=1_000_000,
        description="the largest batch a worker takes of one key (also at most a quarter of "
        "the quota over the workers)",
    )
    interval: Timeout = Field(
        0.01,
        description="how long a bucket's batch lasts (a window's ends with its window, sooner "
        "if this is shorter): a token or leaky bucket admits at most rate x interval beyond "
        "its exact decisions",
    )


class StoreSettings(_Model):
    """Where limit state lives: this process, or Redis shared by every replica."""

    url: str = Field(
        "memory",
        description="memory (shared by the workers when --workers N > 1), shared (one state "
        "for the workers of this machine), redis://host:port/db, rediss://..., or "
        "redis+cluster://host:port for a Redis Cluster (GATEWAY_STORE_URL overrides it)",
    )
    on_failure: Literal["local", "allow", "deny"] = Field(
        "local",
        description="when Redis fails: local (in-process limits divided by replicas), allow "
        "(fail open) or deny (503); when the shared store's directory has no room for a new "
        "key: deny (503), else decided without storing it",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="gateway instances sharing the limits; with --workers N each instance "
        "counts N times in the local fallback",
    )
    timeout: Timeout = Field(0.05, description="deadline of one Redis call")
    key_prefix: str = Field("gw:", pattern=r"^[^{}\s]*$", description="namespace of Redis keys")
    slot_ttl: Timeout = Field(
        10.0,
        description="how long a replica's concurrency slots outlive it in Redis (renewed "
        "every third of it while it runs): a replica that dies or is cut off holds its slots "
        "at most this long",
    )
    client: Literal["thin", "redis-py"] = Field(
        "thin",
        description="thin: the gateway's pipelined client on redis-py's hiredis parser (less "
        "CPU per call, see bench/README.md); redis-py: redis-py's asyncio pipelines",
    )
    worker_lease: WorkerLeaseSettings | None = Field(
        None,
        description="the shared store (--workers N): each worker decides a hot key's requests "
        "from batches of its quota, within the bound each algorithm states (docs/stores.md); "
        "{} for the defaults; omitted: every request decided exactly in the shared state",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not _STORE_URL_RE.match(value):
            raise ValueError(
                f"invalid store url {redact_url(value)!r}: expected memory, shared, redis://, "
                "rediss:// or redis+cluster://"
            )
        return value

    @model_validator(mode="after")
    def _worker_lease_on_the_shared_store(self) -> StoreSettings:
        if self.worker_lease is not None and self.url not in ("memory", "shared"):
            raise ValueError(
                "worker_lease leases between the workers of the shared store (url: shared or "
                "memory); on Redis, lease a limit's quota between replicas with its lease:"
            )
        return self
