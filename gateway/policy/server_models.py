"""``server:``: the proxy's listeners (plain, TLS with its certificates, redirects to HTTPS),
the admin listener, the access log and the limits on clients' connections."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.policy.log_template import is_template, parse_template
from gateway.policy.model_base import (
    _HEADER_NAME_RE,
    Duration,
    LimitLogLevel,
    Size,
    Timeout,
    _Model,
    split_host_port,
)

# An Upgrade protocol name (RFC 9110 token, without a version: "websocket").
_TOKEN_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~\-]{1,64}")


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
    reads it (a `header:NAME` key part, `exempt_headers`), unless `raw` names it. Query
    parameters likewise, by the same words (and `sig`, `code`, `pwd`, `pass`, `jwt`) or a
    `query:NAME` key part: `?api_key=` is logged as `?api_key=sha256:...`."""

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
        description="headers and query parameters written as sent rather than hashed (never "
        "an exempt_headers one)",
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
    metrics_max_models: int = Field(
        20,
        ge=0,
        le=1000,
        description="models (as the responses name them) a limit with cost_from counts its "
        "units under in the metrics' model label, per worker process: the first seen keep "
        'their own series, the others count as model="other" (a response naming none: "")',
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
