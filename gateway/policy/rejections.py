"""A rejection answered the operator's way: ``rejection:`` on a limit or for the whole policy
(status, content type, a body template naming the limit, the retry time and the key's hash).
Without one, a rejection stays the gateway's RFC 9457 problem+json.

The template is parsed when the policy loads (an unknown ``$name`` refused there) and rendered
per rejection from its pieces: no parsing on the request path.
"""

from __future__ import annotations

import re
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

# What a body template may name: ``$limit`` (the rejecting limit's name), ``$status``,
# ``$retry_after`` (whole seconds, as Retry-After says), ``$retry_after_ms``, and
# ``$key_hash`` (``sha256:`` and 12 hex digits of the request's key: a client can compute its
# own, nobody learns another's).
VARIABLES: Final = ("limit", "status", "retry_after", "retry_after_ms", "key_hash")
_VARIABLE_RE: Final = re.compile(r"\$(\w+)|\$\{(\w+)\}")
_CONTENT_TYPE_RE: Final = re.compile(r"^[\w.+-]+/[\w.+-]+(\s*;\s*[\w-]+=[\w.-]+)*$")
MAX_BODY: Final = 16_384


class RejectionResponse(BaseModel):
    """How a rejected request is answered: status, content type and a body template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: int | None = Field(
        None, ge=400, le=599, description="the status (default: the limit's status)"
    )
    content_type: str = Field("application/json", description="the body's Content-Type")
    body: str = Field(
        description="the body: text with $limit, $status, $retry_after (seconds), "
        "$retry_after_ms and $key_hash (sha256 of the request's key, 12 hex digits); $$ for $"
    )

    @field_validator("content_type")
    @classmethod
    def _check_content_type(cls, value: str) -> str:
        if not _CONTENT_TYPE_RE.match(value):
            raise ValueError(f"invalid content type {value!r}: expected type/subtype")
        return value

    @field_validator("body")
    @classmethod
    def _check_body(cls, value: str) -> str:
        if len(value.encode()) > MAX_BODY:
            raise ValueError(f"the body is over {MAX_BODY} bytes")
        parse_body(value)
        return value


def parse_body(template: str) -> tuple[tuple[str, str | None], ...]:
    """The template as (text, variable) pieces; ValueError naming an unknown variable."""
    pieces: list[tuple[str, str | None]] = []
    position = 0
    text = template.replace("$$", "\0")
    for match in _VARIABLE_RE.finditer(text):
        name = match.group(1) or match.group(2)
        if name not in VARIABLES:
            raise ValueError(
                f"unknown variable ${name} in the body: use {', '.join('$' + v for v in VARIABLES)}"
            )
        pieces.append((text[position : match.start()].replace("\0", "$"), name))
        position = match.end()
    pieces.append((text[position:].replace("\0", "$"), None))
    return tuple(pieces)


class RejectionTemplate:
    """A ``RejectionResponse`` ready to render: its pieces parsed once."""

    __slots__ = ("content_type", "pieces", "status")

    def __init__(self, spec: RejectionResponse) -> None:
        self.status = spec.status
        self.content_type = spec.content_type
        self.pieces = parse_body(spec.body)

    def render(self, values: dict[str, str]) -> bytes:
        return "".join(
            text + (values[name] if name is not None else "") for text, name in self.pieces
        ).encode()
