"""Secrets out of everything shown or logged: store URLs keep their host, lose their password;
header values (API keys) are shown by their hash."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"
# A hashed value: this prefix and the first HASH_DIGITS hex digits of the value's SHA-256.
HASHED_PREFIX = "sha256:"
HASH_DIGITS = 12


def hashed(value: str) -> str:
    """``sha256:`` and 12 hex digits of a value's SHA-256: how the dashboard, the limit log
    and the access log show an API key. Unkeyed on purpose: equal values hash equal in every
    process and every log (``gateway replay`` keys on them), and whoever knows a key can
    compute its hash to find it; a key is long and random, so the hash does not give it away."""
    digest = hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()
    return HASHED_PREFIX + digest[:HASH_DIGITS]


# Query parameters of a Redis URL that carry a credential (redis-py reads ``password``).
_SECRET_PARAMS = frozenset({"password", "pass", "passwd", "token", "secret"})
_USERINFO_RE = re.compile(r"//[^/@]*@")
_MALFORMED_RE = re.compile(r"[^/@]*@")
# A URL's userinfo inside free text (an error message that quotes a store URL).
_TEXT_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s'\"]*@")


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``.

    A password with no user (``redis://:secret@host``) keeps its empty user; userinfo with no
    colon is redacted whole (redis-py takes it as the password). Credential query parameters
    (``?password=``) are redacted too; anything unparsable loses all between ``//`` and ``@``.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return _USERINFO_RE.sub(f"//{REDACTED}@", url)
    if "@" not in netloc and "@" in url.partition("?")[0]:  # no scheme: not parsed as a URL
        return _MALFORMED_RE.sub(f"{REDACTED}@", url)
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{hostport}" if colon else f"{REDACTED}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = urlencode(
                [(k, REDACTED if k.lower() in _SECRET_PARAMS else v) for k, v in pairs],
                safe="*",
            )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every ``scheme://user:password@`` in a message becomes ``scheme://***@``."""
    return _TEXT_USERINFO_RE.sub(rf"\1{REDACTED}@", text)
