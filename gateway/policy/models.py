"""The policy file schema: pydantic models are its single source (``gateway schema`` exports it).

Models are frozen and reject unknown keys, so a loaded policy is an immutable snapshot that a reload
swaps whole. Cross-references (a route naming an upstream) are checked in ``policy_loader``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from typing import Annotated, Any, Final, Literal, NamedTuple, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainSerializer,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gateway.policy.cost_from import json_at, parse_cost_from
from gateway.policy.identity import JwtSettings, PlanFrom
from gateway.policy.log_template import is_template, parse_template
from gateway.policy.penalty import Penalty
from gateway.policy.rejections import RejectionResponse
from gateway.policy.units import (
    CALENDAR_PERIODS,
    Rate,
    parse_duration,
    parse_rate,
    parse_size,
    time_zone,
)
from gateway.redact import redact_url


def _duration(value: Any) -> float:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return parse_duration(value)
    raise ValueError(f"invalid duration {value!r}: expected Go syntax like '500ms', '10s', '1m'")


def _size(value: Any) -> int:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return parse_size(value)
    raise ValueError(f"invalid size {value!r}: expected bytes or nginx syntax like '64k', '10m'")


Duration = Annotated[
    float,
    BeforeValidator(_duration),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$|^0$"},
                {"type": "number", "minimum": 0},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds",
        }
    ),
]


_CALENDAR_LIKE_RE = re.compile(r"^\s*\d+\s*(d|w|mo|y)\s*$")


def _window_length(value: Any) -> float | str:
    if isinstance(value, str):
        if value.strip() in CALENDAR_PERIODS:
            return value.strip()
        if _CALENDAR_LIKE_RE.match(value):
            raise ValueError(
                f"invalid window {value!r}: a calendar window is 1d, 1w, 1mo or 1y (with "
                "calendar: true); other windows are Go durations like '90s', '15m', '720h'"
            )
    return _duration(value)


# A window: a duration, or a calendar period (with ``calendar: true``).
WindowLength = Annotated[
    float | str,
    BeforeValidator(_window_length),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$"},
                {"type": "number", "exclusiveMinimum": 0},
                {"enum": list(CALENDAR_PERIODS)},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds; with "
            "calendar: true, 1d, 1w, 1mo or 1y",
        }
    ),
]


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be longer than 0: a zero timeout would expire at once, every time")
    return value


# Timeouts where zero would fail every time (a request disconnected before its headers can
# arrive, a connect that cannot start).
Timeout = Annotated[
    float,
    BeforeValidator(_duration),
    AfterValidator(_positive),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$"},
                {"type": "number", "exclusiveMinimum": 0},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds; above 0",
        }
    ),
]
Size = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\d+[kKmMgG]?$"},
                {"type": "integer", "minimum": 0},
            ],
            "description": "bytes, or nginx-style size ('64k', '10m', '1g')",
        }
    ),
]


def _rate(value: Any) -> Rate:
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        return parse_rate(value)
    raise ValueError(f"invalid rate {value!r}: expected nginx syntax like '10r/s' or '30r/m'")


RateField = Annotated[
    Rate,
    BeforeValidator(_rate),
    PlainSerializer(str, return_type=str),
    WithJsonSchema(
        {"type": "string", "pattern": r"^\d+r/[sm]$", "description": "nginx-style rate: '10r/s'"}
    ),
]

_HOST_PORT_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")
_UPSTREAM_URL_RE = re.compile(
    r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+)(:\d{1,5})?(/[^\s?#]*)?$"
)
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
# An Upgrade protocol name (RFC 9110 token, without a version: "websocket").
_TOKEN_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~\-]{1,64}")


# Names of upstreams and limits: they appear in headers (RateLimit-Policy quotes the limit's
# name), metric labels and Redis keys, so only plain ASCII.
def _check_name(name: str) -> str:
    if not re.fullmatch(_NAME_RE, name):
        raise ValueError(
            f"invalid name {name!r}: use ASCII letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return name


Name = Annotated[
    str, AfterValidator(_check_name), WithJsonSchema({"type": "string", "pattern": _NAME_RE})
]
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


def split_host_port(text: str) -> tuple[str, int]:
    """``'127.0.0.1:8080'`` / ``'[::1]:8080'`` -> host and port; raises ValueError."""
    match = _HOST_PORT_RE.match(text.strip())
    if match is None:
        raise ValueError(f"invalid listen address {text!r}: expected HOST:PORT, e.g. 0.0.0.0:8080")
    host, port = match.group(1), int(match.group(2))
    if port > 65535:
        raise ValueError(f"invalid listen address {text!r}: port out of range")
    return host.strip("[]"), port


def _off(value: Any) -> Any:
    return "off" if value is False else value  # YAML reads a bare `off` as false


# The levels of a limit's rejection lines (nginx's limit_req_log_level); delays one lower.
LimitLogLevel = Annotated[
    Literal["error", "warning", "info", "off"],
    BeforeValidator(_off),
    WithJsonSchema({"enum": ["error", "warning", "info", "off", False]}),
]


def listeners_collide(first: str, second: str) -> bool:
    """Whether two listen addresses would take the same port: one address, or a wildcard and
    an address of its family. With SO_REUSEPORT (``--workers N``) both binds succeed and the
    kernel splits the connections between the two listeners, so this is refused up front."""
    host_a, port_a = split_host_port(first)
    host_b, port_b = split_host_port(second)
    if port_a != port_b or port_a == 0:
        return False
    host_a, host_b = host_a.lower(), host_b.lower()
    if host_a == host_b:
        return True
    wildcard = "::" if ":" in host_a else "0.0.0.0"
    same_family = (":" in host_a) == (":" in host_b)
    return same_family and wildcard in (host_a, host_b)


# Admin paths that may be served without the token; POST /reload never is.
AdminPath = Literal[
    "/healthz", "/readyz", "/metrics", "/dashboard", "/policy", "/explain", "/status"
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _version_text(value: Any) -> Any:
    # YAML reads an unquoted 1.2 as a number.
    return f"{value:.1f}" if isinstance(value, float) else value


# A server name a certificate is chosen by: a host name, or ``*.`` and a domain (any name under
# it, as nginx's ``server_name *.example.com``).
_SERVER_NAME_RE: Final = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


class Certificate(_Model):
    """One certificate of a TLS listener with several: served to the clients whose SNI names
    one of its ``server_names``; the default one to every other client."""

    cert: str = Field(description="PEM certificate chain (relative to the policy file)")
    key: str = Field(description="PEM private key of the certificate (relative to the policy file)")
    server_names: tuple[str, ...] = Field(
        (),
        description="the names (SNI) it is served for: exact (api.example.com) or a wildcard "
        "(*.example.com: any name under example.com); an exact name wins over a wildcard, a "
        "longer wildcard over a shorter",
    )
    default: bool = Field(
        False,
        description="served when the client names no server or one no certificate lists; "
        "when none says so, the first certificate is the default",
    )

    @field_validator("server_names")
    @classmethod
    def _check_server_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(name.strip().lower().rstrip(".") for name in value)
        for name in names:
            if _SERVER_NAME_RE.fullmatch(name) is None:
                raise ValueError(
                    f"invalid server name {name!r}: expected a host name (api.example.com) "
                    "or a wildcard over a domain (*.example.com)"
                )
        return names


class TlsSettings(_Model):
    """TLS on a client listener: a PEM certificate chain and its key (``cert``, ``key``), or
    several chosen by the name the client asks for (``certificates``, SNI). Each is read again
    when its files change and on SIGHUP (one that does not load is refused; the old one stays)."""

    cert: str | None = Field(
        None,
        description="PEM certificate chain (relative to the policy file); with key, or give "
        "certificates instead",
    )
    key: str | None = Field(
        None, description="PEM private key of the certificate (relative to the policy file)"
    )
    certificates: tuple[Certificate, ...] = Field(
        (),
        description="several certificates, chosen by the server name the client sends (SNI), "
        "instead of cert and key",
    )
    min_version: Annotated[Literal["1.2", "1.3"], BeforeValidator(_version_text)] = Field(
        "1.2", description="oldest TLS version accepted: '1.2' or '1.3'"
    )

    @model_validator(mode="after")
    def _one_way_to_name_certificates(self) -> TlsSettings:
        if self.certificates:
            if self.cert is not None or self.key is not None:
                raise ValueError(
                    "give cert and key (one certificate) or certificates (several), not both"
                )
        elif self.cert is None or self.key is None:
            raise ValueError(
                "give cert and key (one certificate) or certificates (several, chosen by SNI)"
            )
        defaults = [i for i, c in enumerate(self.certificates) if c.default]
        if len(defaults) > 1:
            raise ValueError(
                f"certificates[{defaults[0]}] and certificates[{defaults[1]}] are both the "
                "default: give default: true to one"
            )
        seen: dict[str, int] = {}
        for index, certificate in enumerate(self.certificates):
            if not certificate.server_names and index != self.default_index:
                raise ValueError(
                    f"certificates[{index}] has no server_names and is not the default: no "
                    "client would get it (list the names it serves)"
                )
            for name in certificate.server_names:
                if name in seen:
                    raise ValueError(
                        f"server name {name!r} is in certificates[{seen[name]}] and "
                        f"certificates[{index}]: list it once"
                    )
                seen[name] = index
        return self

    @property
    def default_index(self) -> int:
        """The certificate served when no name matches: the one marked, else the first."""
        return next((i for i, c in enumerate(self.certificates) if c.default), 0)

    @property
    def chain_files(self) -> tuple[Certificate, ...]:
        """Every certificate, one per entry (``cert`` and ``key`` make one, the default)."""
        if self.certificates:
            return self.certificates
        assert self.cert is not None and self.key is not None
        return (Certificate(cert=self.cert, key=self.key),)


RedirectStatus = Literal[301, 302, 307, 308]


class Listener(_Model):
    """One listener of ``server.listen`` given as a list: the proxy in plain HTTP, the proxy
    over TLS (``tls``), or a plain-HTTP listener that sends every request to HTTPS
    (``redirect_to_https``)."""

    address: str = Field(description="HOST:PORT to listen on")
    tls: TlsSettings | None = Field(None, description="serve this listener over TLS")
    redirect_to_https: bool | int = Field(
        False,
        description="answer every request with a redirect to https://HOST[:PORT] and the same "
        "path and query, HOST from the request's Host header: true for the port of the first "
        "TLS listener, or the port clients reach HTTPS on (443 behind a port mapping); "
        "not rate-limited, nothing proxied",
    )
    redirect_status: RedirectStatus | None = Field(
        None,
        description="the redirect's status: 301, 302, 307 or 308; by default 301 for GET and "
        "HEAD, 308 for other methods (which keeps the method and body)",
    )

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("redirect_to_https")
    @classmethod
    def _check_redirect_port(cls, value: bool | int) -> bool | int:
        if not isinstance(value, bool) and not 1 <= value <= 65535:
            raise ValueError(f"expected true, false or a port from 1 to 65535, got {value}")
        return value

    @model_validator(mode="after")
    def _redirect_or_serve(self) -> Listener:
        if self.redirect_to_https is not False and self.tls is not None:
            raise ValueError(
                "a listener with tls already serves HTTPS: give it tls or redirect_to_https, "
                "not both"
            )
        if self.redirect_status is not None and self.redirect_to_https is False:
            raise ValueError("redirect_status needs redirect_to_https: true (or a port)")
        return self

    @property
    def redirects(self) -> bool:
        return self.redirect_to_https is not False


def _listen_kind(value: Any) -> str:
    return "address" if isinstance(value, str) else "listeners"


def _listen_address(value: Any) -> Any:
    """``listen`` as one address (checked here, so its error is the field's own) or a list."""
    if isinstance(value, str):
        split_host_port(value)
    elif not isinstance(value, list | tuple):
        raise ValueError(f"expected HOST:PORT (0.0.0.0:8080) or a list of listeners, got {value!r}")
    elif not value:
        raise ValueError("an empty list of listeners: give at least one")
    return value


def _listeners_agree(value: str | tuple[Listener, ...]) -> str | tuple[Listener, ...]:
    """A list's listeners on ports of their own, each redirect with a TLS port to go to."""
    if isinstance(value, str):
        return value
    for index, listener in enumerate(value):
        for before in range(index):
            if listeners_collide(value[before].address, listener.address):
                raise ValueError(
                    f"listen[{before}] ({value[before].address}) and listen[{index}] "
                    f"({listener.address}) take the same port: give each listener its own"
                )
        if listener.redirect_to_https is True and all(other.tls is None for other in value):
            raise ValueError(
                f"listen[{index}] redirects to HTTPS but no listener has tls: add one, or "
                "give redirect_to_https the port clients reach HTTPS on"
            )
    if all(listener.redirects for listener in value):
        raise ValueError("every listener redirects: nothing would serve the proxy")
    return value


Listen = Annotated[
    Annotated[str, Tag("address")] | Annotated[tuple[Listener, ...], Tag("listeners")],
    Discriminator(_listen_kind),
    BeforeValidator(_listen_address),
    AfterValidator(_listeners_agree),
]


# Request headers whose values are credentials by their name: written hashed in the access log
# (as are the headers a limit reads) unless ``access_log.raw`` names them.
_CREDENTIAL_HEADERS: Final = frozenset({"authorization", "proxy-authorization", "cookie"})
_CREDENTIAL_WORDS: Final = (
    "key",
    "token",
    "secret",
    "auth",
    "session",
    "password",
    "passwd",
    "signature",
    "credential",
)


def credential_header(name: str) -> bool:
    """Whether a header's name says it holds a credential: ``Authorization``,
    ``Proxy-Authorization``, ``Cookie``, or a name with key, token, secret, auth, session,
    password, passwd, signature or credential in it (``X-Api-Key``, ``X-Auth-Token``)."""
    lower = name.lower()
    return lower in _CREDENTIAL_HEADERS or any(word in lower for word in _CREDENTIAL_WORDS)


class AccessLogSettings(_Model):
    """The access log: one line per request, where and how the operator chooses. A header
    value is written as `sha256:` and 12 hex digits of its hash when its name says it is a
    credential (Authorization, Proxy-Authorization, Cookie, or a name with key, token,
    secret, auth, session, password, passwd, signature or credential in it) or when a limit
    reads it (a `header:NAME` key part, `exempt_headers`), unless `raw` names it."""

    path: str | None = Field(
        None,
        description="file the lines are appended to (relative to the policy file), reopened on "
        "SIGUSR1 (logrotate); every worker appends to it; absent: stderr",
    )
    format: str = Field(
        "json",
        description="json (one object per line), text (key=value) or a template of "
        "nginx-style $variables ($remote_addr, $request, $status, $http_x_api_key, ...; "
        "docs/operating.md lists them)",
    )
    fields: tuple[str, ...] = Field(
        (),
        description="request headers the json format carries (under headers), such as "
        "[X-Api-Key]: what gateway replay needs to decide limits keyed on them",
    )
    raw: tuple[str, ...] = Field(
        (),
        description="headers written as sent rather than hashed (never an exempt_headers one)",
    )

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an empty path: give a file, or leave path out for stderr")
        return value

    @field_validator("format")
    @classmethod
    def _check_format(cls, value: str) -> str:
        if value in ("json", "text"):
            return value
        if not is_template(value):
            raise ValueError(
                f"format {value!r}: expected json, text or a template of $variables "
                "('$remote_addr \"$request\" $status')"
            )
        parse_template(value)
        return value

    @field_validator("fields", "raw")
    @classmethod
    def _check_header_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _HEADER_NAME_RE.match(name):
                raise ValueError(f"invalid header name {name!r}: expected a name like X-Api-Key")
        return value

    @field_validator("fields")
    @classmethod
    def _fields_need_json(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if value and info.data.get("format", "json") != "json":
            raise ValueError(
                "fields are carried by the json format: a template names its headers itself "
                "($http_x_api_key)"
            )
        return value


# The tags of ``access_log``'s two forms (pydantic names the one tried in an error's place).
ACCESS_LOG_TAGS: Final = frozenset({"bool", "settings"})


def _access_log_kind(value: Any) -> str:
    """``access_log: true`` or its settings: a mapping is read as settings, so its mistakes
    are told as such (not as "expected true or false")."""
    return "settings" if isinstance(value, dict | AccessLogSettings) else "bool"


class ServerSettings(_Model):
    """The client-facing listener and its protections against slow or abusive clients."""

    listen: Listen = Field(
        "0.0.0.0:8080",
        description="HOST:PORT of the proxy listener, or a list of listeners (plain, TLS, "
        "redirect to HTTPS), each as server.listen[] says",
    )
    tls: TlsSettings | None = Field(
        None,
        description="serve the proxy listener over TLS (HTTP/1.1 by ALPN); with listen as a "
        "list, each listener has its own tls",
    )
    admin_listen: str = Field(
        "127.0.0.1:9090", description="HOST:PORT of the admin listener (/healthz, /readyz, ...)"
    )
    workers: int = Field(1, ge=1, le=64, description="processes sharing the listener")
    trusted_proxies: tuple[str, ...] = Field(
        (), description="CIDRs whose forwarding headers are believed (nginx set_real_ip_from)"
    )
    client_ip_header: Literal["x-forwarded-for", "forwarded"] = Field(
        "x-forwarded-for",
        description="the header a trusted proxy names the client in: X-Forwarded-For, or "
        "Forwarded (RFC 7239)",
    )
    header_timeout: Timeout = Field(10.0, description="deadline to receive a request's headers")
    keepalive_timeout: Duration = Field(
        75.0, description="idle time before a client is closed; 0 closes after each response"
    )
    body_timeout: Timeout = Field(
        60.0, description="longest pause between two reads of a request body (408 after)"
    )
    max_connections: int = Field(10000, ge=1, description="open client connections per worker")
    max_body_size: Size = Field(
        100 * 1024 * 1024, description="largest request body; 0 means unlimited"
    )
    max_header_size: Size = Field(8190, ge=256, description="longest request line or header")
    body_key_max_size: Size = Field(
        64 * 1024,
        ge=1,
        description="largest JSON request body a limit's body:FIELD key part is read from "
        "(read before the limits decide, then forwarded unchanged)",
    )
    body_key_too_large: Literal["reject", "absent"] = Field(
        "reject",
        description="a body over body_key_max_size: reject (413) or absent (its body: parts "
        "are missing: the limit's on_missing_key applies)",
    )
    max_headers: int = Field(100, ge=1, description="request headers at most (400 or 431 beyond)")
    underscores_in_headers: bool = Field(
        False,
        description="forward request headers whose names hold an underscore (nginx's "
        "underscores_in_headers); off, they are dropped, since some upstreams read X_Real_IP "
        "as X-Real-IP",
    )
    shutdown_timeout: Duration = Field(
        30.0, description="on SIGTERM, how long in-flight requests may take to finish"
    )
    upgrade_protocols: tuple[str, ...] = Field(
        ("websocket",),
        description="protocols an Upgrade request may switch to, proxied as a byte relay "
        "after the upstream's 101 (h2c is refused); [] forwards every Upgrade as a plain request",
    )
    websocket_idle_timeout: Timeout = Field(
        300.0,
        description="a proxied WebSocket connection with no byte either way for this long is "
        "closed (nginx's proxy_read_timeout on an upgraded connection)",
    )
    client_error_log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="level of the one line (per cause, at most every 10s) logged for a "
        "client's malformed request on either listener; nginx logs these at info",
    )
    pass_upstream_server_header: bool = Field(
        False,
        description="send clients the upstream's Server header; off, they see the gateway's "
        "own (Server: gateway) as nginx does, which names no backend software",
    )
    error_body: Literal["problem", "legacy"] = Field(
        "problem",
        description="body of the gateway's own answers (404, 413, 502, 504, ...): problem "
        "(RFC 9457 application/problem+json, as its 429s), or legacy (application/json "
        "{status, error, message}, for clients written against it)",
    )
    access_log: Annotated[
        Annotated[bool, Tag("bool")] | Annotated[AccessLogSettings, Tag("settings")],
        Discriminator(_access_log_kind),
    ] = Field(
        False,
        description="one line per request: true (stderr, logger gateway.access, in "
        "access_log_format), or where and how (path, format, fields, raw)",
    )
    limit_log_level: LimitLogLevel = Field(
        "warning",
        description="level of the log line a limit writes when it rejects a request (delays one "
        "level lower), at most one per limit per 10 s with the count of the others; off for "
        "none (nginx's limit_req_log_level); a limit's log_level overrides it",
    )
    access_log_format: Literal["text", "json"] = Field(
        "text",
        description="with access_log: true, lines as key=value text or as JSON objects "
        "(access_log.format says it otherwise)",
    )
    drain_delay: Duration = Field(
        0.0,
        description="on SIGTERM, how long /readyz answers 503 before the listeners close, so "
        "a load balancer (Kubernetes endpoints) stops sending traffic first",
    )
    admin_token: str | None = Field(
        None,
        min_length=16,
        description="bearer token the admin listener requires (except on admin_public_paths); "
        "prefer admin_token_file or GATEWAY_ADMIN_TOKEN for secrets",
    )
    admin_token_file: str | None = Field(
        None,
        description="file holding the admin bearer token (relative to the policy file; read at "
        "start and on reload)",
    )
    admin_public_paths: tuple[AdminPath, ...] = Field(
        ("/healthz", "/readyz", "/metrics"),
        description="admin paths served without the token when one is set",
    )
    admin_insecure: bool = Field(
        False,
        description="serve an admin listener off loopback (0.0.0.0, a LAN address) with no "
        "admin token, open to anyone who reaches it (Traefik's api.insecure); off, such a "
        "listener refuses to start; on, every start logs a WARNING",
    )

    @field_validator("admin_listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _check_cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"invalid CIDR {cidr!r} in trusted_proxies") from None
        return value

    @field_validator("upgrade_protocols")
    @classmethod
    def _check_upgrade_protocols(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for token in value:
            if _TOKEN_RE.fullmatch(token) is None:
                raise ValueError(f"invalid protocol {token!r}: expected a token like websocket")
            if token.lower() == "h2c":
                raise ValueError(
                    "h2c cannot be proxied: an upgraded HTTP/2 connection would reach the "
                    "upstream past every check and limit of the gateway"
                )
        return tuple(token.lower() for token in value)

    @model_validator(mode="after")
    def _two_listeners(self) -> ServerSettings:
        if isinstance(self.listen, str):
            if listeners_collide(self.listen, self.admin_listen):
                raise ValueError(
                    f"listen ({self.listen}) and admin_listen ({self.admin_listen}) take the "
                    "same port: give the admin listener a port of its own"
                )
            return self
        if self.tls is not None:
            raise ValueError(
                "tls is for a listen address; with listen as a list, give the TLS listener "
                "its own tls"
            )
        for index, listener in enumerate(self.listen):
            if listeners_collide(listener.address, self.admin_listen):
                raise ValueError(
                    f"listen[{index}] ({listener.address}) and admin_listen "
                    f"({self.admin_listen}) take the same port: give the admin listener a port "
                    "of its own"
                )
        return self

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The proxy's listeners, whichever way the file gives them."""
        if isinstance(self.listen, str):
            return (Listener(address=self.listen, tls=self.tls),)
        return self.listen

    @model_validator(mode="after")
    def _one_access_log_format(self) -> ServerSettings:
        if isinstance(self.access_log, AccessLogSettings) and (
            "access_log_format" in self.model_fields_set
        ):
            raise ValueError(
                "access_log_format is for access_log: true; with access_log's settings, give "
                "the format as access_log.format"
            )
        return self

    def access_log_settings(self) -> AccessLogSettings | None:
        """The access log's settings (``access_log: true`` is stderr in
        ``access_log_format``), or None when it is off."""
        if isinstance(self.access_log, AccessLogSettings):
            return self.access_log
        return AccessLogSettings(format=self.access_log_format) if self.access_log else None

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerSettings:
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ValueError("give admin_token or admin_token_file, not both")
        return self


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


class RouteMatch(_Model):
    """What a request must look like for a route to take it; every given field must match."""

    host: str | None = Field(
        None, description="exact host, or '*.example.com' for any subdomain (port ignored)"
    )
    path_prefix: str | None = Field(None, description="path starts with this")
    path: str | None = Field(None, description="exact path")
    path_regex: str | None = Field(None, description="Python regex matched from the start")
    methods: tuple[str, ...] | None = Field(None, description="request methods, e.g. [GET, POST]")

    @field_validator("path_prefix", "path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"path {value!r} must start with '/'")
        return value

    @field_validator("path_regex")
    @classmethod
    def _check_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid path_regex {value!r}: {exc}") from None
        return value

    @field_validator("methods")
    @classmethod
    def _check_methods(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("methods is empty: it would match no request (omit it for all)")
        upper = tuple(m.upper() for m in value)
        for method in upper:
            if not re.match(r"^[A-Z]+$", method):
                raise ValueError(f"invalid method {method!r}: expected a method name like GET")
        return upper

    @model_validator(mode="after")
    def _one_path_rule(self) -> RouteMatch:
        given = [f for f in ("path_prefix", "path", "path_regex") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of path_prefix, path, path_regex (got {given})")
        return self


class Route(_Model):
    """Requests matching ``match`` go to ``upstream``; routes are tried in file order."""

    name: Name = Field(description="the route's name in metrics, logs and limits")
    match: RouteMatch = Field(RouteMatch(), description="omitted: every request")
    upstream: str = Field(description="name of an upstream in upstreams")
    connect_timeout: Timeout | None = Field(None, description="the upstream's, for this route")
    read_timeout: Timeout | None = Field(None, description="the upstream's, for this route")
    max_body_size: Size | None = Field(
        None, description="server.max_body_size for this route; 0 means unlimited"
    )


_KEY_PART_RE = re.compile(
    r"^(client_ip|route|method|global|header:[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
    r"|query:[^\s&=]+|const:\S+|plan:[A-Za-z0-9][A-Za-z0-9_.\-]*"
    r"|body:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*|jwt:[A-Za-z0-9_.:\-/]+)$"
)
# The values a ``plan:LIMIT`` key part takes besides a plan's name: a key that limit does not
# list (or a request without one), and a key listed with numbers of its own.
UNLISTED_PLAN: Final = "unlisted"
CUSTOM_PLAN: Final = "custom"


def check_key_parts(value: tuple[str, ...], *, plans: bool = False) -> tuple[str, ...]:
    """Key parts as a limit's ``key`` (``plans``: with ``plan:LIMIT``) and a pool's
    ``hash_key`` take them."""
    if not value:
        raise ValueError("key needs at least one part")
    for part in value:
        limit_only = part.startswith(("plan:", "body:", "jwt:"))
        if not _KEY_PART_RE.match(part) or (limit_only and not plans):
            expected = (
                "global, const:TEXT, plan:LIMIT, jwt:CLAIM or body:FIELD (a JSON field of the "
                "request body: model, metadata.user)"
                if plans
                else "global or const:TEXT"
            )
            raise ValueError(
                f"invalid key part {part!r}: expected client_ip, header:NAME, query:NAME, "
                f"route, method, {expected}"
            )
    return value


class LimitMatch(RouteMatch):
    """Which requests a limit applies to: routes by name and/or request rules; empty = all."""

    routes: tuple[str, ...] | None = Field(None, description="route names this limit covers")

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError(
                "routes is empty: the limit would apply to no request (omit it for all)"
            )
        return value


class LeaseSettings(_Model):
    """Quota leasing on the Redis store: each replica takes batches of the limit's quota and
    decides from them locally (``gateway/stores/redis/lease.py`` says how grants are sized)."""

    share: float = Field(
        0.5, gt=0, le=1, description="a grant is at most this fraction of what remains"
    )
    low_water: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="below this fraction of the quota left, a grant is at most the share split "
        "evenly among the replicas that asked recently (above it, at most an even part of what "
        "remains)",
    )
    interval: Timeout | None = Field(
        None,
        description="a replica asks for what it spent over this long (with no history yet, for "
        "the quota's units over this long); a token bucket's lease expires after it (default: a "
        "fifth of the window, or of the bucket's refill time)",
    )


# Why an algorithm cannot be leased: a grant is a batch of whole admissions taken ahead.
_NOT_LEASABLE = {
    "leaky_bucket": "a leaky_bucket that delays cannot be leased: its delays are computed per "
    "request from the shared state (nginx-exact), a batch taken ahead cannot shape them; lease "
    "one with nodelay: true",
    "sliding_log": "sliding_log cannot be leased: it is exact per request timestamp, a batch "
    "taken ahead has none",
    "concurrency": "concurrency cannot be leased: a slot is given back when its request ends, "
    "and a batch of slots taken ahead would be held by nobody",
}


_HEADER_NAME_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class Cost(_Model):
    """What one request costs a limit: by route name, else by method, else ``default``."""

    default: int = Field(1, ge=1, description="cost of a request no other entry names")
    routes: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="route name -> cost (asked first)"
    )
    methods: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="method -> cost"
    )

    @field_validator("methods")
    @classmethod
    def _upper(cls, value: dict[str, int]) -> dict[str, int]:
        return {method.upper(): cost for method, cost in value.items()}

    def of(self, route: str, method: str) -> int:
        cost = self.routes.get(route)
        if cost is None:
            cost = self.methods.get(method, self.default)
        return cost


class ReserveFrom(_Model):
    """A reservation read from the request's JSON body (``reserve: {body: max_tokens, default:
    4096}``): the first of the fields present that holds a whole number of 1 or more, else
    ``default``."""

    body: tuple[str, ...] = Field(
        description="fields of the request body (dotted), the first present giving the "
        "reservation: max_tokens, max_completion_tokens, max_output_tokens",
    )
    default: int = Field(ge=1, description="the reservation when none of the fields is there")

    @field_validator("body", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("body")
    @classmethod
    def _check_fields(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("body is empty: name the request's field (max_tokens)")
        for name in value:
            if not _BODY_FIELD_RE.match(name):
                raise ValueError(
                    f"{name!r} is not a field of a JSON body: write a dotted name "
                    "(max_tokens, generation.max_tokens)"
                )
        return value

    def of_body(self, document: object) -> int:
        """The reservation for a request whose body is ``document`` (None: not read)."""
        for name in self.body:
            value = json_at(document, name.split("."))
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 53:
                return value
        return self.default


_BODY_FIELD_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


# ``5xx``: every status of a class.
_STATUS_CLASS_RE = re.compile(r"^[1-5]xx$")
# Headers that frame the message or the connection: never a cost header, since removing one
# would break the response.
_FRAMING_HEADERS = frozenset(
    {"connection", "content-length", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
)


def _status_item(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if 100 <= value <= 599:
            return value
    elif isinstance(value, str):
        text = value.strip().lower()
        if _STATUS_CLASS_RE.match(text):
            return text
        if text.isascii() and text.isdigit() and 100 <= int(text) <= 599:
            return int(text)
    raise ValueError(
        f"invalid status {value!r}: expected a status code from 100 to 599 (401) or a class ('5xx')"
    )


StatusItem = Annotated[
    int | str,
    BeforeValidator(_status_item),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 100, "maximum": 599},
                {"type": "string", "pattern": "^[1-5][xX][xX]$"},
            ],
            "description": "a status code (401) or a class of them ('5xx')",
        }
    ),
]


class ResponseCount(_Model):
    """Which responses a limit is charged for: the request is admitted while the key has room
    and charged after its response, only when the status matches."""

    statuses: tuple[StatusItem, ...] = Field(
        description="status codes (401) and classes ('5xx') of the responses charged"
    )

    @field_validator("statuses")
    @classmethod
    def _some(cls, value: tuple[int | str, ...]) -> tuple[int | str, ...]:
        if not value:
            raise ValueError(
                "statuses is empty: the limit would charge no response (omit count to charge "
                "every response)"
            )
        return value

    def codes(self) -> frozenset[int]:
        """Every status code charged."""
        codes: set[int] = set()
        for item in self.statuses:
            if isinstance(item, int):
                codes.add(item)
            else:
                first = int(item[0]) * 100
                codes.update(range(first, first + 100))
        return frozenset(codes)


class _LimitBase(_Model):
    lease: LeaseSettings | None = Field(
        None,
        description="take batches of this limit from the Redis store and decide locally "
        "(fixed_window, sliding_window, token_bucket in reject mode, leaky_bucket with nodelay); "
        "{} for the defaults",
    )
    key: tuple[str, ...] = Field(
        ("client_ip",),
        description="parts joined into the key: client_ip, header:NAME, query:NAME, route, "
        "method, global, const:TEXT, plan:LIMIT (the plan another limit's overrides give the "
        "request's key: a plan's name, custom, or unlisted), jwt:CLAIM (a claim of the "
        "request's verified token, see jwt)",
    )
    on_missing_key: Literal["skip", "client_ip"] = Field(
        "skip",
        description="when a header/query key part is absent: skip the limit, or use "
        "the client IP in its place",
    )
    match: LimitMatch = Field(LimitMatch(), description="omitted: every request")
    dry_run: bool = Field(False, description="count would-delay/would-reject, never enforce")
    status: int = Field(429, ge=400, le=599, description="status for rejected requests")
    rejection: RejectionResponse | None = Field(
        None,
        description="how this limit's rejections are answered (status, content type, body "
        "template); default: the policy's rejection, else problem+json",
    )
    penalty: Penalty | None = Field(
        None,
        description="a key rejected that often is refused at once for a while: {after: 10, "
        "within: 1m, block: 15m, status: 429 or 403}",
    )
    max_delay: Duration = Field(
        30.0, description="a request that would wait longer is rejected at once"
    )
    max_queue: int = Field(1000, ge=0, description="requests waiting on this limit at most")
    max_keys: int = Field(100_000, ge=1, description="tracked keys; least recently used evicted")
    log_level: LimitLogLevel | None = Field(
        None,
        description="level of this limit's rejection lines (delays one lower), or off; "
        "default: server.limit_log_level",
    )
    top_keys: Literal["hashed", "plain"] = Field(
        "hashed",
        description="how the dashboard's top limited keys show header: and query: key parts "
        "(often API keys): hashed (sha256, 12 hex digits) or plain",
    )

    cost: int | Cost = Field(
        1,
        description="units one request takes from the quota: a number, or a default with "
        "per-route and per-method costs",
    )
    count: ResponseCount | None = Field(
        None,
        description="charge only responses with these statuses, after the response: a request "
        "is admitted while the key has room, and holds its cost while in flight (see hold)",
    )
    cost_header: str | None = Field(
        None,
        description="response header in which the upstream says what the request cost, in "
        "the limit's units, charged after the response (missing or invalid: cost)",
    )
    keep_cost_header: bool = Field(
        False, description="leave the cost header in the response the client gets"
    )
    cost_from: str | None = Field(
        None,
        description="where the response body says what the request cost (an LLM API's "
        "usage), charged after the response: openai, anthropic, a dotted path "
        "(usage.total_tokens) or a sum of paths (usage.prompt_tokens + "
        "usage.completion_tokens); read from a JSON body or as a stream's events pass "
        "(missing: reserve, or cost)",
    )
    reserve: Annotated[int, Field(ge=1)] | ReserveFrom | None = Field(
        None,
        description="units a request of a limit charged after the response holds while in "
        "flight (an estimate of its cost: a model call's most tokens), settled to what the "
        "response says: a number, or {body: max_tokens, default: 4096} read from the "
        "request's JSON body; default: cost",
    )
    hold: Literal["in_flight", "none"] = Field(
        "in_flight",
        description="a limit charged after the response (count, cost_header): in_flight "
        "(each request in flight holds its cost of the key's budget from admission until "
        "its response is settled, so at most the budget left can be in flight) or none "
        "(admitted free while the key has room, charged after: a burst in flight may all "
        "pass)",
    )
    exempt: tuple[str, ...] = Field(
        (), description="CIDRs of clients this limit does not apply to (other limits still do)"
    )
    exempt_headers: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="header name -> values (e.g. an internal service token) whose requests "
        "this limit does not apply to; compared in constant time, never logged",
    )
    plans: dict[Name, dict[str, Any]] = Field(
        default_factory=dict,
        description="named parameter sets (rate/burst, or limit/window) overrides can name",
    )
    overrides: dict[str, Name | dict[str, Any]] = Field(
        default_factory=dict,
        description="key value (or CIDR for a client_ip key) -> a plan's name or its own "
        "parameters; the most specific CIDR wins",
    )
    overrides_file: str | None = Field(
        None,
        description="YAML or JSON file of more overrides (relative to the policy file), "
        "reloaded with the policy",
    )
    plan_from: PlanFrom | None = Field(
        None,
        description="the plan named by the request: {jwt: CLAIM}, a claim of its verified "
        "token whose value is one of plans (another value, or none: the limit's own numbers)",
    )
    unlisted: Literal["own", "shared", "reject"] = Field(
        "own",
        description="keys the overrides do not list (a key a client invents): own (each its "
        "own bucket at the limit's numbers), shared (all of them one bucket), or reject (403)",
    )
    exempt_listed: Name | None = Field(
        None,
        description="the name of another limit: requests whose key that limit's overrides "
        "list (a client on a plan) bypass this limit",
    )

    @field_validator("cost")
    @classmethod
    def _check_cost(cls, value: int | Cost) -> int | Cost:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"cost must be at least 1, got {value}")
        return value

    @field_validator("cost_header")
    @classmethod
    def _check_cost_header(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _HEADER_NAME_RE.match(value):
            raise ValueError(f"invalid header name {value!r} in cost_header")
        if value.lower() in _FRAMING_HEADERS:
            raise ValueError(
                f"{value} frames the response, it cannot be a cost header (removing it would "
                "break the response)"
            )
        return value

    @field_validator("exempt")
    @classmethod
    def _check_exempt(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"invalid CIDR {cidr!r} in exempt") from None
        return value

    @field_validator("exempt_headers")
    @classmethod
    def _check_exempt_headers(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for name, secrets in value.items():
            if not _HEADER_NAME_RE.match(name):
                raise ValueError(f"invalid header name {name!r} in exempt_headers")
            if not secrets or any(not s for s in secrets):
                raise ValueError(f"exempt_headers {name!r}: give one or more non-empty values")
        return value

    @model_validator(mode="after")
    def _check_overrides(self) -> _LimitBase:
        tier_specs(self, self.overrides)
        if self.unlisted != "own" and not (self.overrides or self.overrides_file):
            raise ValueError(
                f"unlisted: {self.unlisted} needs overrides (or an overrides_file) that list "
                "keys: without them every key is unlisted"
            )
        return self

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_key_parts(value, plans=True)

    @model_validator(mode="after")
    def _check_plan_from(self) -> _LimitBase:
        if self.plan_from is None:
            return self
        if not self.plans:
            raise ValueError("plan_from names a plan of plans: define plans")
        if self.overrides or self.overrides_file or self.unlisted != "own":
            raise ValueError(
                "plan_from and overrides (overrides_file, unlisted) both choose a key's plan: "
                "use one of them"
            )
        return self

    @property
    def charged_after(self) -> bool:
        """Whether the limit charges after the response (``count``, ``cost_header``,
        ``cost_from``)."""
        return self.count is not None or self.cost_header is not None or self.cost_from is not None

    @field_validator("cost_from")
    @classmethod
    def _check_cost_from(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cost_from(value)  # BadCostFrom, a ValueError, says what to write
            return value.strip()
        return value

    @model_validator(mode="after")
    def _chargeable_after(self) -> _LimitBase:
        if self.keep_cost_header and self.cost_header is None:
            raise ValueError("keep_cost_header applies to a cost_header: name one, or remove it")
        if "hold" in self.model_fields_set and not self.charged_after:
            raise ValueError(
                "hold applies to a limit charged after the response (count, cost_header or "
                "cost_from): a limit charged at admission holds its cost already; remove hold"
            )
        if self.reserve is not None:
            if not self.charged_after:
                raise ValueError(
                    "reserve applies to a limit charged after the response (cost_from, "
                    "cost_header or count): a limit charged at admission takes its cost; "
                    "remove reserve, or use cost"
                )
            if self.hold == "none":
                raise ValueError(
                    "reserve is what a request holds while in flight, and hold: none holds "
                    "nothing; remove one of them"
                )
            if self.cost != 1:
                raise ValueError(
                    "reserve replaces cost at admission (and is what a missing usage is "
                    "charged): remove cost"
                )
        if self.cost_from is not None and self.cost_header is not None:
            raise ValueError(
                "cost_from and cost_header both say what a response cost: keep one of them"
            )
        if not self.charged_after:
            return self
        given = [
            name
            for name in ("count", "cost_header", "cost_from")
            if getattr(self, name) is not None
        ]
        subject = f"{' and '.join(given)} charge{'' if len(given) > 1 else 's'} after the response"
        algorithm = getattr(self, "algorithm", "")
        if algorithm == "leaky_bucket":
            raise ValueError(
                f"{subject}, which a leaky_bucket cannot: it delays each request by the state "
                "it finds; use a token_bucket in reject mode or a window algorithm"
            )
        if getattr(self, "mode", "reject") != "reject":
            raise ValueError(
                f"{subject}, which a token_bucket in queue mode cannot: a limit charged after "
                "the response never delays; use mode: reject"
            )
        if getattr(self, "warmup", None):
            raise ValueError(
                f"{subject}, which a token_bucket with warmup cannot: its ramp is computed per "
                "request; remove warmup"
            )
        if self.lease is not None:
            raise ValueError(
                f"{subject}, which a leased limit cannot: a lease is a batch of admissions "
                "taken ahead; remove lease"
            )
        return self

    @model_validator(mode="after")
    def _leasable(self) -> _LimitBase:
        if self.lease is None:
            return self
        algorithm = getattr(self, "algorithm", "")
        # A leaky bucket with nodelay never delays: it is leased as a token bucket of burst + 1.
        nodelay = algorithm == "leaky_bucket" and getattr(self, "nodelay", False)
        if algorithm in _NOT_LEASABLE and not nodelay:
            raise ValueError(_NOT_LEASABLE[algorithm])
        if getattr(self, "mode", "reject") != "reject" or getattr(self, "warmup", None):
            raise ValueError(
                "a token_bucket with mode: queue or warmup cannot be leased: its delays and "
                "ramp are computed per request; lease one in reject mode without warmup"
            )
        if self.overrides or self.overrides_file or self.cost != 1:
            # A lease is a batch of one parameter set's unit admissions.
            raise ValueError(
                "a leased limit takes no overrides, overrides_file or cost (not supported yet)"
            )
        return self


class LeakyBucketLimit(_LimitBase):
    """nginx ``limit_req``: ``rate``, ``burst``, and ``nodelay`` or ``delay=N``."""

    algorithm: Literal["leaky_bucket"] = Field(description="nginx limit_req, bit for bit")
    rate: RateField
    burst: int = Field(0, ge=0, description="excess requests admitted (delayed unless nodelay)")
    nodelay: bool = Field(False, description="admit the burst at once instead of delaying it")
    delay: int | None = Field(None, ge=0, description="requests served without delay (nginx)")

    @model_validator(mode="after")
    def _delay_or_nodelay(self) -> LeakyBucketLimit:
        if self.nodelay and self.delay is not None:
            raise ValueError("give nodelay or delay, not both")
        if self.delay is not None and self.delay > self.burst:
            raise ValueError(f"delay ({self.delay}) cannot exceed burst ({self.burst})")
        return self

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``): how long the
        quota, ``burst + 1`` requests, takes to refill."""
        return (self.burst + 1) / self.rate.per_second


# A calendar period's nominal length in seconds (what ``RateLimit-Policy`` advertises as its
# window; a month is 30 days and a year 365, as Kong counts them): the algorithm counts to the
# period's real end.
_NOMINAL_PERIOD_S: dict[str, float] = {
    "1d": 86_400.0,
    "1w": 7 * 86_400.0,
    "1mo": 30 * 86_400.0,
    "1y": 365 * 86_400.0,
}


class WindowLimit(_LimitBase):
    """At most ``limit`` requests per ``window`` (fixed, sliding counter, or exact sliding log)."""

    algorithm: Literal["fixed_window", "sliding_window", "sliding_log"] = Field(
        description="aligned windows (on the calendar with calendar: true); two windows "
        "weighted (approximate); every request's time kept (exact)"
    )
    limit: int = Field(ge=1, description="requests per window")
    window: WindowLength = Field(
        description="the window's length, above 0; with calendar: true, 1d, 1w, 1mo or 1y"
    )
    calendar: bool = Field(
        False,
        description="a fixed window on the calendar: window 1d, 1w (from Monday), 1mo or 1y, "
        "from local midnight in timezone (a daylight-saving day is 23 or 25 hours)",
    )
    timezone: str = Field(
        "UTC", description="IANA time zone of a calendar window ('Europe/Berlin')"
    )

    @field_validator("window")
    @classmethod
    def _positive_window(cls, value: float | str) -> float | str:
        if isinstance(value, float) and value <= 0:
            raise ValueError("window must be longer than 0")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        time_zone(value)
        return value

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``); a calendar
        period's nominal length."""
        if isinstance(self.window, str):
            return _NOMINAL_PERIOD_S[self.window]
        return self.window

    @model_validator(mode="after")
    def _calendar_window(self) -> WindowLimit:
        if not self.calendar:
            if isinstance(self.window, str):
                raise ValueError(
                    f"window {self.window} is a calendar period: add calendar: true (and a "
                    "timezone, UTC if none)"
                )
            if self.timezone != "UTC":
                raise ValueError("timezone applies to a calendar window: add calendar: true")
            return self
        if self.algorithm != "fixed_window":
            raise ValueError(
                f"a calendar window is a fixed window: use algorithm: fixed_window, not "
                f"{self.algorithm}"
            )
        if not isinstance(self.window, str):
            seconds = int(self.window) if self.window.is_integer() else self.window
            raise ValueError(f"a calendar window is 1d, 1w, 1mo or 1y, got a window of {seconds} s")
        if self.lease is not None:
            raise ValueError("a calendar window cannot be leased (not supported yet)")
        return self


class TokenBucketLimit(_LimitBase):
    """``rate`` refill with ``burst`` capacity; ``queue`` waits for tokens (Guava semantics)."""

    algorithm: Literal["token_bucket"] = Field(description="Guava RateLimiter semantics")
    rate: RateField
    burst: int = Field(1, ge=1, description="bucket capacity in tokens")
    mode: Literal["reject", "queue"] = Field(
        "reject", description="reject: no token, no entry; queue: wait for the tokens (Guava)"
    )
    warmup: Duration | None = Field(None, description="ramp from a third of rate to rate")

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``): how long the
        quota, ``burst`` tokens, takes to refill."""
        return self.burst / self.rate.per_second


class ConcurrencyLimit(_LimitBase):
    """nginx ``limit_conn``: at most ``limit`` requests in flight per key (``cost`` slots each),
    a slot held until the response has been sent, the client went away or the upstream
    failed."""

    algorithm: Literal["concurrency"] = Field(
        description="requests in flight per key (nginx limit_conn)"
    )
    limit: int = Field(ge=1, description="slots held at once per key (a request holds cost)")
    max_delay: Duration = Field(
        0.0,
        description="how long a request over the limit may wait for a slot (first come, first "
        "served); 0 rejects it at once, as nginx's limit_conn does",
    )
    retry_after: Duration = Field(
        1.0, description="Retry-After on a rejection (when a slot frees cannot be known)"
    )
    max_keys: int = Field(
        100_000,
        ge=1,
        description="keys holding slots at once; a request under a new key beyond them is "
        "rejected (nginx's full zone), none is evicted",
    )

    @model_validator(mode="after")
    def _cost_fits(self) -> ConcurrencyLimit:
        """Each plan and override is checked so too: ``variant_spec`` validates its limit
        with this cost."""
        cost = self.cost
        if isinstance(cost, int):
            named, largest = "cost", cost
        else:
            costs = {
                "cost.default": cost.default,
                **{f"cost.routes.{name}": value for name, value in cost.routes.items()},
                **{f"cost.methods.{name}": value for name, value in cost.methods.items()},
            }
            named, largest = max(costs.items(), key=lambda item: item[1])
        if largest > self.limit:
            raise ValueError(
                f"{named} ({largest}) exceeds limit ({self.limit}): a request needing more "
                "slots than the limit has could never be admitted"
            )
        return self

    @property
    def window_s(self) -> float:
        """Slots are given back, not refilled: no quota window is advertised for them (the IETF
        draft has no RateLimit field for concurrency)."""
        return 0.0


# What a plan or an override may set: the algorithm's numbers (and a calendar window's time
# zone: a customer's month is theirs), nothing about keys or matching.
OVERRIDE_PARAMS = frozenset(
    {"rate", "burst", "limit", "window", "nodelay", "delay", "warmup", "timezone"}
)
# What a plan's parameters are checked with but cannot change (a plan's warmup cannot ramp a
# limit charged after the response).
_VARIANT_CONTEXT = frozenset({"calendar", "count", "cost_header", "cost_from", "reserve"})


def variant_spec(spec: Any, params: dict[str, Any]) -> Any:
    """``spec`` with a plan's or an override's parameters (ValueError naming what is wrong)."""
    model = type(spec)
    unknown = sorted(set(params) - (OVERRIDE_PARAMS & set(model.model_fields)))
    if unknown:
        allowed = sorted(OVERRIDE_PARAMS & set(model.model_fields))
        raise ValueError(
            f"{', '.join(map(repr, unknown))} cannot be set for {spec.algorithm} "
            f"(expected {', '.join(allowed)})"
        )
    fields = {
        name: getattr(spec, name)
        for name in OVERRIDE_PARAMS | _VARIANT_CONTEXT
        if name in model.model_fields
    }
    if "hold" in spec.model_fields_set:  # checked with the limit's; the default otherwise
        fields["hold"] = spec.hold
    # The cost too, so that a model checking its numbers against it checks the variant's.
    if spec.reserve is None:  # reserve refuses a cost: the limit's own is 1 then
        fields["cost"] = spec.cost
    try:
        checked = model.model_validate({"algorithm": spec.algorithm, **fields, **params})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        reason = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {reason}" if where else reason) from None
    return spec.model_copy(update={name: getattr(checked, name) for name in params})


class OverrideError(ValueError):
    """A bad override: ``entry`` is its key value, so a loader can find its line."""

    def __init__(self, entry: str, reason: str) -> None:
        self.entry = entry
        super().__init__(f"override {entry!r}: {reason}")


class Tiers(NamedTuple):
    """Overrides resolved: each key value's tier, and each tier's spec. A tier's name stays
    the same across reloads: the plan's, or ``=`` and a digest of its numbers."""

    of_value: dict[str, str]
    specs: dict[str, Any]


def tier_specs(spec: Any, overrides: dict[str, Any]) -> Tiers:
    """``overrides`` resolved against the limit's plans; ValueError naming the first bad plan
    or override (``OverrideError`` for an override)."""
    plans: dict[str, Any] = {}
    for name, params in spec.plans.items():
        if name in (UNLISTED_PLAN, CUSTOM_PLAN):
            raise ValueError(
                f"plan {name!r}: the name is reserved (a plan: key part gives it to keys "
                f"{'not listed' if name == UNLISTED_PLAN else 'with numbers of their own'})"
            )
        try:
            plans[name] = variant_spec(spec, params)
        except ValueError as exc:
            raise ValueError(f"plan {name!r}: {exc}") from None
    specs: dict[str, Any] = {}
    of_value: dict[str, str] = {}
    by_params: dict[str, str] = {}
    networks = spec.key == ("client_ip",)
    for value, target in overrides.items():
        if target.__class__ is str:
            if target not in specs:
                plan = plans.get(target)
                if plan is None:
                    known = ", ".join(sorted(plans)) or "none defined"
                    raise OverrideError(value, f"unknown plan {target!r} (plans: {known})")
                specs[target] = plan
            of_value[value] = target
            continue
        if not isinstance(target, dict):
            raise OverrideError(value, "expected a plan's name or a mapping of parameters")
        signature = repr(sorted(target.items()))
        tier = by_params.get(signature)
        if tier is None:
            try:
                custom = variant_spec(spec, target)
            except ValueError as exc:
                raise OverrideError(value, str(exc)) from None
            tier = "=" + hashlib.blake2s(signature.encode(), digest_size=4).hexdigest()
            by_params[signature] = tier
            specs[tier] = custom
        of_value[value] = tier
    if networks:
        for value in of_value:
            if "/" in value:
                try:
                    ipaddress.ip_network(value, strict=False)
                except ValueError:
                    raise OverrideError(value, "invalid CIDR") from None
    return Tiers(of_value, specs)


# The model of each name ``algorithm:`` takes, and the names, for error messages.
ALGORITHM_MODELS: dict[str, type[_LimitBase]] = {
    name: model
    for model in (LeakyBucketLimit, WindowLimit, TokenBucketLimit, ConcurrencyLimit)
    for name in get_args(model.model_fields["algorithm"].annotation)
}
ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_MODELS)
Limit = Annotated[
    LeakyBucketLimit | WindowLimit | TokenBucketLimit | ConcurrencyLimit,
    Field(discriminator="algorithm"),
]


class RateLimitHeaders(_Model):
    """Which rate-limit headers responses carry (on 2xx as well as on rejections)."""

    ietf: bool = Field(True, description="RateLimit-Policy and RateLimit (IETF httpapi draft)")
    x_ratelimit: bool = Field(False, description="X-RateLimit-Limit/-Remaining/-Reset")
    retry_after: bool = Field(True, description="Retry-After on rejections")
    openai: bool = Field(
        False,
        description="OpenAI's x-ratelimit-{limit,remaining,reset}-tokens (limits with "
        "cost_from) and -requests (the others)",
    )

    rejected_by: str | None = Field(
        None,
        description="a header naming the limit that rejected a request (e.g. "
        "X-RateLimit-Rejected-By), on its rejections only; none by default (the problem "
        "body's limit names it always)",
    )

    @field_validator("rejected_by")
    @classmethod
    def _check_rejected_by(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER_NAME_RE.match(value):
            raise ValueError(f"invalid header name {value!r}")
        if value is not None and value.lower() in _FRAMING_HEADERS | {"retry-after"}:
            raise ValueError(f"{value} is a header the gateway writes itself: choose another name")
        return value


class Access(_Model):
    """Allowed clients bypass every limit; denied clients get 403."""

    allow: tuple[str, ...] = Field((), description="CIDRs that bypass every limit")
    deny: tuple[str, ...] = Field((), description="CIDRs answered 403")

    @field_validator("allow", "deny")
    @classmethod
    def _check_cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"invalid CIDR {cidr!r}") from None
        return value


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


def policy_json_schema() -> dict[str, Any]:
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Gateway policy file"
    return schema
