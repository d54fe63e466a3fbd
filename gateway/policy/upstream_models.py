"""``upstreams:``: the backends a route forwards to, one server or a pool, with its balancing,
retries, health checks, outlier ejection, TLS and adaptive in-flight limit."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from gateway.policy.model_base import (
    Duration,
    Size,
    Timeout,
    _Model,
    check_key_parts,
    split_host_port,
)

_UPSTREAM_URL_RE = re.compile(
    r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+)(:\d{1,5})?(/[^\s?#]*)?$"
)


class AdaptiveSettings(_Model):
    """An in-flight limit on an upstream that the gateway sets itself from the latency it
    measures: a gradient controller (``gateway/algorithms/gradient_limit.py`` says how it
    moves). Beyond the limit a request waits up to ``max_delay`` for a place, or gets
    ``status`` with ``Retry-After``."""

    min_limit: int = Field(
        3,
        ge=1,
        description="the limit never goes below this; the minimum latency is measured with "
        "this many requests in flight",
    )
    max_limit: int = Field(1000, ge=1, description="the limit never goes above this")
    initial_limit: int | None = Field(
        None,
        ge=1,
        description="the limit at the start (default: max_limit), while the minimum latency is "
        "measured from the requests that start with at most min_limit in flight; the gradient "
        "takes it down from there. min_limit measures at the floor first, shedding what is "
        "beyond it meanwhile",
    )
    buffer: float = Field(
        0.15,
        gt=0,
        le=1,
        description="latency tolerated above the minimum, as a fraction of it: the limit grows "
        "while the measured latency stays within it and shrinks as it rises beyond",
    )
    min_buffer: Duration = Field(
        0.001,
        description="the tolerated latency above the minimum is at least this (event loops "
        "move latency by about a millisecond without any queue at the upstream)",
    )
    sample_interval: Duration = Field(0.1, description="how often the limit moves")
    probe_interval: Duration = Field(
        30.0,
        description="how often the minimum latency is measured again (the limit is held at "
        "min_limit meanwhile, for probe_requests requests, 2 s at most)",
    )
    probe_requests: int = Field(
        25, ge=1, description="requests whose latency makes one measurement of the minimum"
    )
    jitter: float = Field(
        0.15,
        ge=0,
        le=1,
        description="each probe_interval is lengthened by up to this fraction of it at random, "
        "so that gateways and workers do not measure at the same moment",
    )
    max_delay: Duration = Field(
        0.0,
        description="how long a request beyond the limit may wait for a place (first come, "
        "first served); 0 answers status at once",
    )
    max_queue: int = Field(1000, ge=0, description="requests waiting for this upstream at most")
    status: int = Field(503, ge=400, le=599, description="status of a request shed")
    retry_after: Duration = Field(1.0, description="Retry-After on a request shed")

    @field_validator("sample_interval", "probe_interval")
    @classmethod
    def _positive_interval(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be longer than 0: the limit would be measured without pause")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveSettings:
        if self.min_limit > self.max_limit:
            raise ValueError(
                f"min_limit ({self.min_limit}) cannot exceed max_limit ({self.max_limit})"
            )
        initial = self.initial_limit
        if initial is not None and not self.min_limit <= initial <= self.max_limit:
            raise ValueError(
                f"initial_limit ({initial}) must be between min_limit ({self.min_limit}) and "
                f"max_limit ({self.max_limit})"
            )
        return self


def _check_server_url(value: str, demo: bool = False) -> str:
    """An http:// or https:// URL (``demo``: where an upstream's url may be builtin:demo)."""
    match = _UPSTREAM_URL_RE.match(value)
    if not match:
        also = ", or 'builtin:demo'" if demo else ""
        raise ValueError(
            f"invalid upstream url {value!r}: expected http://host[:port][/path] or "
            f"https://host[:port][/path]{also}"
        )
    if match.group(2) and not 0 < int(match.group(2)[1:]) <= 65535:
        raise ValueError(f"invalid upstream url {value!r}: port out of range")
    return value


class UpstreamServer(_Model):
    """One server of an upstream's pool (nginx's ``server`` in an ``upstream`` block)."""

    url: str = Field(description="http://host:port[/base-path] or https://...")
    weight: int = Field(1, ge=1, le=1000, description="share of requests, relative to the others")
    backup: bool = Field(
        False, description="sent requests only while no other server of the pool is available"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        # builtin:demo only as an upstream's url (Upstream refuses it among servers).
        return value if value == "builtin:demo" else _check_server_url(value)


def _server_entry(value: Any) -> Any:
    return {"url": value} if isinstance(value, str) else value


ServerEntry = Annotated[UpstreamServer, BeforeValidator(_server_entry)]

# What sends a request on to the next server (nginx's proxy_next_upstream): a connection that
# failed or timed out, or one of these statuses.
RetryOn = Literal["error", "timeout", 500, 502, 503, 504, 403, 404, 429]


class RetrySettings(_Model):
    """When a request is tried again on another server of the pool (nginx's
    ``proxy_next_upstream``, ``_tries`` and ``_timeout``).

    A request is sent again only if nothing of it can have been acted on twice: after a failed
    connect (nothing went out), any request whose body was not yet read; after the request went
    out, only an idempotent method (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) whose body, if any,
    was small enough to be held in memory (``buffer_body``). Never a POST or PATCH once sent.
    """

    when: tuple[RetryOn, ...] = Field(
        ("error", "timeout"),
        description="error (connect failed, connection reset), timeout, and statuses among "
        "500, 502, 503, 504, 403, 404, 429; [] never retries",
    )
    tries: int = Field(
        0, ge=0, description="attempts in all, the first included; 0: each server once at most"
    )
    retry_timeout: Duration = Field(
        0.0, description="no new attempt once this long has passed since the first; 0: no limit"
    )
    buffer_body: Size = Field(
        64 * 1024,
        description="an idempotent request's body of at most this many bytes (Content-Length) "
        "is read whole before it is sent, so it can be sent again; 0 streams every body",
    )

    @field_validator("when", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return tuple(v.lower() if isinstance(v, str) else v for v in value)
        return value


class OutlierDetection(_Model):
    """Envoy's outlier ejection: each ``interval``, a server whose share of 5xx answers, or whose
    latency, stands out from its peers' is ejected for a time that grows each time it is."""

    interval: Timeout = Field(10.0, description="how often the servers are compared")
    min_requests: int = Field(
        10, ge=1, description="a server with fewer answers in an interval is not judged"
    )
    error_share: float | None = Field(
        0.3,
        gt=0,
        le=1,
        description="ejected when its share of 5xx answers is this much above the median of "
        "its peers' (0.3: 30 points); null: errors never eject",
    )
    latency_factor: float | None = Field(
        5.0,
        gt=1,
        description="ejected when its mean latency is this many times the median of its peers' "
        "(and above min_latency); null: latency never ejects",
    )
    min_latency: Duration = Field(
        0.01, description="a mean latency below this never ejects (a fast pool's jitter)"
    )
    base_ejection_time: Timeout = Field(
        30.0, description="first ejection's length; each further one adds as much"
    )
    max_ejection_time: Timeout = Field(300.0, description="longest ejection")
    max_ejection_percent: int = Field(
        10,
        ge=0,
        le=100,
        description="at most this share of the pool ejected at once (at least one server, as "
        "Envoy; 0 ejects none)",
    )


class HealthCheck(_Model):
    """Active checks: a request to each server every ``interval``, over the pool's connections."""

    path: str = Field("/", description="path requested (GET)")
    interval: Timeout = 5.0
    timeout: Timeout = Field(2.0, description="an answer later than this fails the check")
    healthy: int = Field(2, ge=1, description="passes in a row that bring a server back")
    unhealthy: int = Field(3, ge=1, description="failures in a row that take a server out")
    expect_status: tuple[int, ...] = Field(
        (), description="statuses that pass; empty: any 2xx or 3xx"
    )

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.startswith("/") or any(c in value for c in " \r\n"):
            raise ValueError(f"health_check path {value!r} must start with '/', no spaces")
        return value

    @field_validator("expect_status")
    @classmethod
    def _check_status(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"expect_status {status} is not an HTTP status")
        return value


class Upstream(_Model):
    """A backend the gateway forwards to: one server (``url``) or a pool (``servers``), each
    server with its own keep-alive connections and these timeouts."""

    url: str | None = Field(
        None,
        description="http://host:port[/base-path], https://..., or 'builtin:demo' for the "
        "demo backend the gateway starts itself (a pool of one)",
    )
    servers: tuple[ServerEntry, ...] | None = Field(
        None, description="the pool: URLs, or {url, weight, backup}"
    )
    balance: Literal["round_robin", "least_inflight", "hash"] = Field(
        "round_robin",
        description="round_robin (weighted, smooth as nginx's), least_inflight (fewest requests "
        "in flight, by weight), hash (consistent hashing on hash_key)",
    )
    hash_key: tuple[str, ...] | None = Field(
        None,
        description="with balance: hash, the key parts a request is hashed on, as a limit's "
        "key (client_ip, header:X-Tenant, ...); a missing part hashes the client IP",
    )
    max_fails: int = Field(
        1,
        ge=0,
        description="failed attempts within fail_timeout that take a server out for "
        "fail_timeout, then one trial request (nginx); 0: never; a pool of one never",
    )
    fail_timeout: Timeout = 10.0
    retry: RetrySettings = Field(
        RetrySettings(),
        description="when a request goes on to another server (nginx's proxy_next_upstream)",
    )
    outlier_detection: OutlierDetection | None = Field(
        None, description="eject servers that stand out from their peers; {} for the defaults"
    )
    health_check: HealthCheck | None = Field(None, description="active checks; off unless set")
    resolve_interval: Timeout | None = Field(
        None,
        description="resolve the servers' host names again this often, a server per address "
        "(a headless service's pods come and go); off: resolved at each connect",
    )
    resolver: str | None = Field(
        None,
        description="HOST:PORT of the DNS server asked with resolve_interval (nginx's "
        "resolver); default: the system's resolver",
    )
    connect_timeout: Timeout = Field(
        5.0, description="deadline to connect (502 when refused, 504 when it passes)"
    )
    read_timeout: Timeout = Field(
        60.0, description="longest wait for the upstream's answer and between two reads (504)"
    )
    max_connections: int = Field(256, ge=1, description="open connections to each server")
    max_idle: int | None = Field(
        None,
        ge=0,
        description="idle keep-alive connections kept (default: max_connections; fewer makes "
        "the pool close and reopen connections under load)",
    )
    idle_timeout: Timeout = Field(60.0, description="idle keep-alive connections closed after")
    ca_file: str | None = Field(
        None,
        description="https:// servers: PEM file of the CA certificates their certificates are "
        "verified against (a private CA), instead of the system's; relative to the policy file",
    )
    client_cert: str | None = Field(
        None,
        description="https:// servers: PEM certificate the gateway presents to a server that "
        "asks for one (mutual TLS); with its key unless client_key names another file",
    )
    client_key: str | None = Field(None, description="PEM private key of client_cert")
    adaptive: AdaptiveSettings | None = Field(
        None,
        description="protect this upstream with an in-flight limit the gateway finds from its "
        "latency; {} for the defaults",
    )

    @model_validator(mode="after")
    def _tls_settings(self) -> Upstream:
        given = [name for name in ("ca_file", "client_cert", "client_key") if getattr(self, name)]
        urls = [server.url for server in self.server_list()] if self.url or self.servers else []
        if given and not any(url.startswith("https://") for url in urls):
            raise ValueError(
                f"{', '.join(given)}: TLS settings are for https:// servers, and this upstream "
                f"has none ({', '.join(urls)})"
            )
        if self.client_key and not self.client_cert:
            raise ValueError("client_key without client_cert: give the certificate it belongs to")
        return self

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None or value == "builtin:demo":
            return value
        return _check_server_url(value, demo=True)

    @field_validator("hash_key")
    @classmethod
    def _check_hash_key(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else check_key_parts(value)

    @field_validator("resolver")
    @classmethod
    def _check_resolver(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                split_host_port(value)
            except ValueError:
                raise ValueError(
                    f"invalid resolver {value!r}: expected HOST:PORT, e.g. 127.0.0.1:53"
                ) from None
        return value

    @model_validator(mode="after")
    def _one_shape(self) -> Upstream:
        if (self.url is None) == (self.servers is None):
            raise ValueError("give url (one server) or servers (a pool), one of them")
        if self.servers is not None:
            if not self.servers:
                raise ValueError("servers is empty: give at least one")
            if all(server.backup for server in self.servers):
                raise ValueError("every server is a backup: at least one must not be")
            urls = [server.url for server in self.servers]
            if "builtin:demo" in urls:
                raise ValueError("builtin:demo is an upstream's url, not a server of a pool")
            for url in urls:
                if urls.count(url) > 1:
                    raise ValueError(f"server {url!r} is listed twice (raise its weight instead)")
        if (self.balance == "hash") != (self.hash_key is not None):
            raise ValueError("balance: hash needs hash_key, and hash_key needs balance: hash")
        if self.resolver is not None and self.resolve_interval is None:
            raise ValueError("resolver is only asked with resolve_interval: give both")
        if self.url == "builtin:demo" and self.resolve_interval is not None:
            raise ValueError("builtin:demo has no host name to resolve")
        return self

    def server_list(self) -> tuple[UpstreamServer, ...]:
        """The pool's servers; ``url`` is a pool of one."""
        if self.servers is not None:
            return self.servers
        assert self.url is not None
        return (UpstreamServer(url=self.url),)
