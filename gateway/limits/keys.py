"""Limit keys: which bucket a request falls in, built from the parts a policy names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from multidict import CIMultiDictProxy, MultiMapping

from gateway.limits.addresses import request_client_key
from gateway.policy.cost_from import json_at
from gateway.policy.overrides import UNLISTED_KEY
from gateway.redact import hashed


class RequestFacts:
    """What key parts are read from; computed once per request.

    A plain class, not a dataclass: compiled, a dataclass's ``__init__`` is the one the
    ``dataclasses`` module writes at run time, interpreted (bench/README.md)."""

    __slots__ = ("body", "client_key", "headers", "identity", "method", "query", "route")

    def __init__(
        self,
        client_key: str,
        route: str,
        method: str,
        headers: CIMultiDictProxy[str],
        query: Callable[[], MultiMapping[str]],
    ) -> None:
        self.client_key = client_key  # the client IP, IPv6 grouped by prefix
        self.route = route
        self.method = method
        self.headers = headers
        self.query = query
        # The request body's JSON document, for ``body:FIELD`` parts: read only when a limit
        # has one (None: no body, not JSON, or larger than the policy reads).
        self.body: object = None
        # The request's token verdict (``limits.token_verifier``), worked out on first use.
        self.identity: object = None

    @classmethod
    def of(
        cls,
        client_ip: str,
        ipv6_prefix: int,
        route: str,
        method: str,
        headers: CIMultiDictProxy[str],
        query: Callable[[], MultiMapping[str]],
    ) -> RequestFacts:
        """A request's facts, as the proxy, ``/explain`` and ``gateway replay`` all make them:
        ``query`` is called only if a key reads the query string."""
        # Not ``cls(...)``: compiled, naming the class calls its native constructor directly.
        return RequestFacts(
            request_client_key(client_ip, ipv6_prefix), route, method, headers, query
        )


Part = Callable[[RequestFacts], str | None]


# Key parts are joined with SEP. A value the client sends (a header, a query parameter) that
# contains SEP or TAG is replaced by TAG "x" and its hex, and a missing part's client-IP stand-in
# is TAG "ip" and the address: no value a client sends can pose as another part, or as the
# fallback bucket of another client's IP.
SEP = "\x1f"
TAG = "\x1e"
assert UNLISTED_KEY.startswith(TAG)  # unlisted: shared's one key is a stand-in too


def client_value(value: str | None) -> str | None:
    """A value a client sent, tagged if it holds the key's separators (a JWT's claims too)."""
    if value is not None and (SEP in value or TAG in value):
        return TAG + "x" + value.encode("utf-8", "surrogateescape").hex()
    return value


def _header(name: str) -> Part:
    def read(facts: RequestFacts) -> str | None:
        return client_value(facts.headers.get(name))

    return read


def _query(name: str) -> Part:
    def read(facts: RequestFacts) -> str | None:
        return client_value(facts.query().get(name))

    return read


def _body(path: list[str]) -> Part:
    def read(facts: RequestFacts) -> str | None:
        value = json_at(facts.body, path)
        if isinstance(value, str):
            return client_value(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return None  # absent, or not a text or a whole number

    return read


def _const(text: str) -> Part:
    def read(facts: RequestFacts) -> str | None:
        return text

    return read


_FIXED: Mapping[str, Part] = {
    "client_ip": lambda f: f.client_key,
    "route": lambda f: f.route,
    "method": lambda f: f.method,
    "global": lambda f: "",
}


def _part(
    spec: str, plan_of: Callable[[str], Part] | None, jwt_of: Callable[[str], Part] | None
) -> Part:
    if spec in _FIXED:
        return _FIXED[spec]
    kind, _, arg = spec.partition(":")
    if kind == "header":
        return _header(arg)
    if kind == "query":
        return _query(arg)
    if kind == "const":
        return _const(arg)
    if kind == "body":
        return _body(arg.split("."))
    if kind == "plan" and plan_of is not None:
        return plan_of(arg)
    if kind == "jwt" and jwt_of is not None:
        return jwt_of(arg)
    raise ValueError(f"unknown key part {spec!r}")


class KeyBuilder:
    """Joins a limit's key parts; ``None`` means the limit does not apply (missing part, skip).

    ``plan_of``: the part ``plan:LIMIT`` reads, given LIMIT (the engine knows the limits);
    ``jwt_of``: the part ``jwt:CLAIM`` reads, given CLAIM (the engine holds the verifier)."""

    __slots__ = ("_fallback_to_ip", "_only", "_parts", "spec")

    def __init__(
        self,
        spec: tuple[str, ...],
        on_missing_key: str = "skip",
        plan_of: Callable[[str], Part] | None = None,
        jwt_of: Callable[[str], Part] | None = None,
    ) -> None:
        self.spec = spec
        self._parts = tuple(_part(p, plan_of, jwt_of) for p in spec)
        self._fallback_to_ip = on_missing_key == "client_ip"
        # A key of one part the request always has (``[client_ip]``, ``[route]``,
        # ``[global]``, ``[method]``): read as a field, not through its part's function.
        self._only = _ONLY.get(spec[0], _ANY) if len(spec) == 1 else _ANY

    def build(self, facts: RequestFacts) -> str | None:
        only = self._only
        if only != _ANY:
            if only == _CLIENT_IP:
                return facts.client_key
            if only == _ROUTE:
                return facts.route
            if only == _GLOBAL:
                return ""
            return facts.method
        parts = self._parts
        if len(parts) == 1:
            value = parts[0](facts)
            if value is None and self._fallback_to_ip:
                return TAG + "ip" + facts.client_key
            return value
        values = []
        for part in parts:
            value = part(facts)
            if value is None:
                if not self._fallback_to_ip:
                    return None
                value = TAG + "ip" + facts.client_key
            values.append(value)
        return SEP.join(values)


# What a key of one fixed part reads (``KeyBuilder._only``); ``_ANY``: its parts' functions.
_ANY: Final = 0
_CLIENT_IP: Final = 1
_ROUTE: Final = 2
_GLOBAL: Final = 3
_METHOD: Final = 4
_ONLY: Final[dict[str, int]] = {
    "client_ip": _CLIENT_IP,
    "route": _ROUTE,
    "global": _GLOBAL,
    "method": _METHOD,
}


def key_in_words(key: str) -> str:
    """A key for people: its parts joined with ' · ', the tagged ones spelled out (the limit
    log and the replay report; ``dashboard.js``'s ``keyPart`` reads them alike)."""
    return " · ".join(_part_in_words(part) for part in key.split(SEP))


def _part_in_words(part: str) -> str:
    if part == UNLISTED_KEY:
        return "(unlisted keys, shared)"
    if part.startswith(TAG + "ip"):
        return f"{part[3:]} (no key: client IP)"
    if part.startswith(TAG + "x"):
        return f"hex:{part[2:]}"
    return part


# Parts whose values a client sends (API keys, tokens, user ids): shown hashed.
_CLIENT_PARTS: Final = ("header:", "query:", "body:")


def shown_key(spec: tuple[str, ...], key: str, plain: bool = False) -> str:
    """A key as the dashboard shows it: ``header:`` and ``query:`` parts (API keys, tokens)
    as ``sha256:`` and 12 hex digits of their hash, unless the limit opts in to plain values.
    The hash of a known value can be computed to find it; a client-IP stand-in stays as is."""
    if plain or key == UNLISTED_KEY or not any(p.startswith(_CLIENT_PARTS) for p in spec):
        return key
    values = key.split(SEP) if len(spec) > 1 else [key]
    shown = []
    for part, value in zip(spec, values, strict=False):
        if part.startswith(_CLIENT_PARTS) and not value.startswith(TAG + "ip"):
            value = hashed(value)
        shown.append(value)
    return SEP.join(shown)
