"""Who is asking: the policy's ``jwt:`` settings (how a request's token is found and verified)
and a limit's ``plan_from:`` (its plan named by a claim).

A module of its own, imported by ``models.py``: a first piece of the schema split by concern.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator

from gateway.policy.model_base import _Model
from gateway.policy.units import parse_duration

# Each key source verifies the algorithms of its own family only: a secret never checks an
# RS256 token's signature and a public key never an HS256 one (the "algorithm confusion"
# attack), and ``none`` is no algorithm at all.
HMAC_ALGORITHMS: Final = ("HS256", "HS384", "HS512")
PUBLIC_KEY_ALGORITHMS: Final = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
    "Ed25519",
)
TokenAlgorithm = Literal[
    "HS256",
    "HS384",
    "HS512",
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
    "Ed25519",
]
# A claim a key part or a plan reads: a top-level claim's name.
CLAIM_RE: Final = re.compile(r"^[A-Za-z0-9_.:\-/]+$")
_HEADER_NAME_RE: Final = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def _seconds(value: Any) -> float:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return parse_duration(value)
    raise ValueError(f"invalid duration {value!r}: expected Go syntax like '500ms', '10s', '1m'")


Seconds = Annotated[
    float,
    BeforeValidator(_seconds),
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
TokenProblem = Literal["401", "anonymous", "reject"]


def _problem(value: Any) -> Any:
    # YAML reads an unquoted 401 as a number.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class JwtSettings(_Model):
    """Where a request's JSON Web Token is, and how it is verified: `jwt:CLAIM` key parts
    and `plan_from: {jwt: CLAIM}` read its claims once it is."""

    header: str = Field(
        "Authorization",
        description="request header holding the token (Authorization: read as 'Bearer TOKEN')",
    )
    cookie: str | None = Field(
        None, description="cookie holding the token, read when the header has none"
    )
    secret_file: str | None = Field(
        None,
        description="file holding the HMAC secret (HS256/384/512), relative to the policy file",
    )
    public_key_file: str | None = Field(
        None,
        description="PEM file of the public key (RS*, PS*, ES*, EdDSA), relative to the "
        "policy file",
    )
    jwks_url: str | None = Field(
        None,
        description="URL of a JSON Web Key Set: fetched at start and on a token naming an "
        "unknown kid (at most once per jwks_min_refresh); the last good set kept when it fails",
    )
    algorithms: tuple[TokenAlgorithm, ...] | None = Field(
        None,
        description="the algorithms accepted (default: HS256 for secret_file, every public-key "
        "algorithm for public_key_file and jwks_url); of the key source's family only",
    )
    issuer: str | None = Field(None, description="required iss claim")
    audience: str | None = Field(None, description="required in the aud claim")
    leeway: Seconds = Field(30.0, description="clock skew allowed on exp and nbf")
    on_missing: Annotated[TokenProblem, BeforeValidator(_problem)] = Field(
        "anonymous",
        description="a request without a token: anonymous (its jwt: key parts are missing: "
        "the limit's on_missing_key decides), 401, or reject (403)",
    )
    on_invalid: Annotated[TokenProblem, BeforeValidator(_problem)] = Field(
        "401",
        description="a token that fails verification (signature, exp, nbf, iss, aud, "
        "algorithm): 401, anonymous, or reject (403)",
    )
    jwks_timeout: Seconds = Field(
        2.0, description="the longest a request waits for the key set fetched for its kid"
    )
    jwks_min_refresh: Seconds = Field(
        30.0, description="the shortest time between two fetches of jwks_url"
    )
    cache_size: int = Field(
        10_000, ge=1, description="verified tokens remembered (each until its exp)"
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> JwtSettings:
        given = [
            name
            for name in ("secret_file", "public_key_file", "jwks_url")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "name one key source: secret_file (HS256), public_key_file (PEM) or jwks_url"
                + (f", not {' and '.join(given)}" if given else "")
            )
        family = HMAC_ALGORITHMS if self.secret_file is not None else PUBLIC_KEY_ALGORITHMS
        for algorithm in self.algorithms or ():
            if algorithm not in family:
                raise ValueError(
                    f"algorithm {algorithm} cannot be verified with {given[0]}: "
                    f"use {', '.join(family)}"
                )
        if self.algorithms == ():
            raise ValueError("algorithms: name at least one, or leave it out")
        if not _HEADER_NAME_RE.match(self.header):
            raise ValueError(f"invalid header name {self.header!r}")
        if self.jwks_url is not None and not self.jwks_url.startswith(("http://", "https://")):
            raise ValueError(f"jwks_url {self.jwks_url!r}: expected an http:// or https:// URL")
        return self

    @property
    def accepted(self) -> tuple[str, ...]:
        """The algorithms a token may name, pinned to the key source's family."""
        if self.algorithms:
            return tuple(self.algorithms)
        return ("HS256",) if self.secret_file is not None else PUBLIC_KEY_ALGORITHMS


class PlanFrom(_Model):
    """A limit's plan named by the request itself: a claim of its token whose value is one of
    the limit's plans (another value, or none: the limit's own numbers)."""

    jwt: str = Field(description="the claim naming the plan, e.g. tier")

    @model_validator(mode="after")
    def _check_claim(self) -> PlanFrom:
        if not CLAIM_RE.match(self.jwt):
            raise ValueError(f"invalid claim name {self.jwt!r}")
        return self
