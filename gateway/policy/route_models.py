"""``routes:``: which requests go to which upstream (a limit's ``match`` extends the same
rules)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from gateway.policy.model_base import Name, Size, Timeout, _Model


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
