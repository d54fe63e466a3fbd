"""The policy file schema: pydantic models are its single source (``gateway schema`` exports it).

Models are frozen and reject unknown keys, so a loaded policy is an immutable snapshot that a reload
swaps whole. Cross-references (a route naming an upstream) are checked in ``policy_loader``.

``Policy`` is the whole file; each of its sections has a module of its own (``server_models``,
``upstream_models``, ``route_models``, ``limit_models`` with ``limit_fields`` and ``plans``,
``store_models``, the shared field types in ``model_base``), and every name they define for
other modules is importable from here as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.policy.identity import JwtSettings
from gateway.policy.limit_fields import (
    Cost,
    LeaseSettings,
    LimitMatch,
    RateField,
    ReserveFrom,
    ResponseCount,
    StatusItem,
    WindowLength,
)
from gateway.policy.limit_models import (
    ALGORITHM_MODELS,
    ALGORITHMS,
    Access,
    ConcurrencyLimit,
    LeakyBucketLimit,
    Limit,
    RateLimitHeaders,
    TokenBucketLimit,
    WindowLimit,
)
from gateway.policy.model_base import (
    KNOWN_METHODS,
    Duration,
    LimitLogLevel,
    Name,
    Size,
    Timeout,
    _Model,
    check_key_parts,
    split_host_port,
)
from gateway.policy.plans import (
    CUSTOM_PLAN,
    OVERRIDE_PARAMS,
    UNLISTED_PLAN,
    OverrideError,
    Tiers,
    tier_specs,
    variant_spec,
)
from gateway.policy.rejections import RejectionResponse
from gateway.policy.route_models import Route, RouteMatch
from gateway.policy.server_models import (
    ACCESS_LOG_TAGS,
    AccessLogSettings,
    AdminPath,
    Certificate,
    Listen,
    Listener,
    RedirectStatus,
    ServerSettings,
    TlsSettings,
    credential_header,
    listeners_collide,
)
from gateway.policy.store_models import StoreSettings, WorkerLeaseSettings
from gateway.policy.upstream_models import (
    AdaptiveSettings,
    HealthCheck,
    OutlierDetection,
    RetryOn,
    RetrySettings,
    ServerEntry,
    Upstream,
    UpstreamServer,
)

# The names other modules import from here (each defined in its section's module).
__all__ = [
    "ACCESS_LOG_TAGS",
    "ALGORITHMS",
    "ALGORITHM_MODELS",
    "CUSTOM_PLAN",
    "KNOWN_METHODS",
    "OVERRIDE_PARAMS",
    "UNLISTED_PLAN",
    "Access",
    "AccessLogSettings",
    "AdaptiveSettings",
    "AdminPath",
    "Certificate",
    "ConcurrencyLimit",
    "Cost",
    "Duration",
    "HealthCheck",
    "LeakyBucketLimit",
    "LeaseSettings",
    "Limit",
    "LimitLogLevel",
    "LimitMatch",
    "Listen",
    "Listener",
    "OutlierDetection",
    "OverrideError",
    "Policy",
    "RateField",
    "RateLimitHeaders",
    "RedirectStatus",
    "ReserveFrom",
    "ResponseCount",
    "RetryOn",
    "RetrySettings",
    "Route",
    "RouteMatch",
    "ServerEntry",
    "ServerSettings",
    "Size",
    "StatusItem",
    "StoreSettings",
    "Tiers",
    "Timeout",
    "TlsSettings",
    "TokenBucketLimit",
    "Upstream",
    "UpstreamServer",
    "WindowLength",
    "WindowLimit",
    "WorkerLeaseSettings",
    "check_key_parts",
    "credential_header",
    "headers_limits_read",
    "listeners_collide",
    "policy_json_schema",
    "query_limits_read",
    "split_host_port",
    "tier_specs",
    "variant_spec",
]


class Policy(_Model):
    """A whole policy file."""

    version: Literal[1] = Field(1, description="the file format's version")
    server: ServerSettings = Field(ServerSettings(), description="listeners and connections")
    upstreams: dict[Name, Upstream] = Field(default_factory=dict, description="backends, by name")
    routes: tuple[Route, ...] = Field(
        (), description="which upstream a request goes to; the first route that matches"
    )
    limits: dict[Name, Limit] = Field(
        default_factory=dict, description="rate limits, by name; all that apply are stacked"
    )
    headers: RateLimitHeaders = Field(
        RateLimitHeaders(), description="the rate-limit headers of responses"
    )
    access: Access = Field(Access(), description="clients allowed past every limit, or denied")
    ipv6_prefix: int = Field(64, ge=1, le=128, description="IPv6 clients grouped by this prefix")
    store: StoreSettings = Field(StoreSettings(), description="where the limits' state lives")
    rejection: RejectionResponse | None = Field(
        None,
        description="how rejections are answered unless their limit says otherwise (status, "
        "content type, body template); default: RFC 9457 problem+json naming the limit",
    )
    jwt: JwtSettings | None = Field(
        None,
        description="the request's JSON Web Token, verified: what jwt:CLAIM key parts and "
        "plan_from read",
    )


def headers_limits_read(policy: Policy) -> tuple[frozenset[str], frozenset[str]]:
    """The request headers the policy's limits read, lower-case: those their keys name
    (``header:NAME``), and those their ``exempt_headers`` name (whose values are secrets)."""
    keyed = {
        part.partition(":")[2].lower()
        for spec in policy.limits.values()
        for part in spec.key
        if part.startswith("header:")
    }
    exempt = {name.lower() for spec in policy.limits.values() for name in spec.exempt_headers}
    return frozenset(keyed), frozenset(exempt)


def query_limits_read(policy: Policy) -> frozenset[str]:
    """The query parameters the policy's limits key on (``query:NAME``), lower-case."""
    return frozenset(
        part.partition(":")[2].lower()
        for spec in policy.limits.values()
        for part in spec.key
        if part.startswith("query:")
    )


def policy_json_schema() -> dict[str, Any]:
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Gateway policy file"
    return schema
