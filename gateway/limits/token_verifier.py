"""A request's JSON Web Token verified, once per token: what ``jwt:CLAIM`` key parts and a
limit's ``plan_from`` read.

Verification (signature, algorithm, ``exp``/``nbf`` with leeway, ``iss``, ``aud``) runs the first
time a token is seen; a token seen before costs a dict hit until its ``exp`` (a bounded table
keyed by the header value that carried it, the oldest entry out first), and one refused before
is refused from the same table for ten seconds. Each key source accepts its own algorithm
family only, pinned before the signature is checked: ``alg: none`` and a public key used as an
HMAC secret are refused by name.

Interpreted, not compiled: it calls joserfc, and its hot path (the caches) is a dict probe.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final

from joserfc import jwt
from joserfc.errors import JoseError, SecurityWarning

from gateway.limits.jwks import JwksKeys
from gateway.limits.keys import client_value
from gateway.log_throttle import LogThrottle
from gateway.policy.identity import JwtSettings
from gateway.policy.jwt_keys import Key, load_static_key

log = logging.getLogger("gateway.jwt")

# A token without ``exp`` is remembered this long once verified.
NO_EXP_TTL_S: Final = 300.0
# A refused token is refused without another verification this long.
REFUSED_TTL_S: Final = 10.0
STATUS_OF: Final = {"401": 401, "reject": 403}


class TokenRefused(Exception):
    """A request the policy refuses for its token (``on_missing``/``on_invalid``: 401 or
    reject): ``status`` and ``reason`` are what the client is answered."""

    def __init__(self, status: int, reason: str, cause: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.cause = cause


class TokenVerdict:
    """One token's verdict: its claims as key parts (``parts``, claim -> value), none
    (anonymous), or the refusal to answer; good until ``until`` (wall-clock seconds)."""

    __slots__ = ("parts", "refusal", "unknown_kid", "until")

    def __init__(
        self,
        parts: Mapping[str, str] | None,
        refusal: TokenRefused | None = None,
        unknown_kid: bool = False,
        until: float = math.inf,
    ) -> None:
        self.parts = parts
        self.refusal = refusal
        self.unknown_kid = unknown_kid
        self.until = until


ANONYMOUS: Final = TokenVerdict(None)


class _Invalid(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail


class TokenVerifier:
    """Finds, verifies and remembers the tokens of one policy's ``jwt`` settings."""

    def __init__(
        self,
        settings: JwtSettings,
        *,
        wall_clock: Callable[[], float] = time.time,
        previous: TokenVerifier | None = None,
        throttle: LogThrottle | None = None,
    ) -> None:
        self.settings = settings
        self._clock = wall_clock
        self._accepted = frozenset(settings.accepted)
        self._leeway = settings.leeway
        self._cache_size = settings.cache_size
        self._header = settings.header
        self._bearer = settings.header.lower() == "authorization"
        self._cookie = settings.cookie
        self._static: Key | None = load_static_key(settings)
        self._throttle = throttle or LogThrottle(log, 10.0)
        # token -> its verdict, verified or refused, until it is no longer good: one dict
        # probe for a token seen before.
        self._verdicts: dict[str | tuple[str], TokenVerdict] = {}
        self.jwks: JwksKeys | None = None
        if settings.jwks_url is not None:
            kept = previous.jwks if previous is not None else None
            self.jwks = JwksKeys(
                settings.jwks_url,
                settings.jwks_min_refresh,
                keys=kept.keys if kept is not None and kept.url == settings.jwks_url else None,
                throttle=self._throttle,
                # A key left the set: what it verified is verified again.
                on_removed=self._verdicts.clear,
            )
        self.verifications = 0

    def reread_key(self) -> bool:
        """Read ``secret_file`` or ``public_key_file`` again (a reload whose policy is
        unchanged: the key rotated in place). True if the key changed: the tokens verified
        with the old one are then verified again, with the new one. ``KeyFileError`` (a
        ``ValueError``: the file gone, too short, a private key) changes nothing."""
        if self._static is None:
            return False
        key = load_static_key(self.settings)
        if key is None or key.as_dict(private=True) == self._static.as_dict(private=True):
            return False
        self._static = key
        self._verdicts.clear()
        return True

    def start(self) -> None:
        """Fetch the key set now if there is none yet (a runtime about to serve calls it;
        ``check`` builds an engine without fetching)."""
        if self.jwks is not None and not self.jwks.keys:
            self.jwks.refresh()

    def close(self) -> None:
        if self.jwks is not None:
            self.jwks.close()

    # -- the request path --

    def part(self, claim: str) -> Callable[[Any], str | None]:
        """The key part ``jwt:CLAIM``: the claim's value, ``None`` when anonymous or the
        claim is absent (or not a string or number); raises ``TokenRefused`` when the policy
        refuses the request's token."""
        verdict_of = self.verdict
        # The common case inline: a token seen before, still good, found by the header's
        # value as sent (nothing sliced or stripped first: one probe, no allocation).
        header = self._header
        verdicts = self._verdicts
        clock = self._clock

        def read(facts: Any) -> str | None:
            verdict = facts.identity
            if verdict is None:
                verdict = verdicts.get(facts.headers.get(header))
                if verdict is not None and clock() < verdict.until:
                    facts.identity = verdict
                else:
                    verdict = verdict_of(facts)
            parts = verdict.parts
            if parts is None:
                if verdict.refusal is not None:
                    raise verdict.refusal
                return None
            return parts.get(claim)  # type: ignore[no-any-return]

        return read

    def claim(self, facts: Any, name: str) -> str | None:
        return self.part(name)(facts)

    def verdict(self, facts: Any) -> TokenVerdict:
        """The request's token verdict, worked out once per request (kept on its facts)."""
        verdict = facts.identity
        if verdict is not None:
            return verdict  # type: ignore[no-any-return]
        headers = facts.headers
        value = headers.get(self._header)
        # Remembered by the header's value as sent (looked up before anything is sliced or
        # stripped), or, for a token from the cookie, by the token in a tuple (no header
        # value can be one).
        remembered_as: str | tuple[str]
        if value is not None:
            remembered_as = value
            verdict = self._verdicts.get(value)
            if verdict is not None and self._clock() < verdict.until:
                facts.identity = verdict
                return verdict
            token = self._token_in(value)
        else:
            token = _cookie_value(headers.get("Cookie"), self._cookie) if self._cookie else None
            remembered_as = (token,) if token is not None else ("",)
        if token is None:
            verdict = self._without_token()
        else:
            verdict = self._verdicts.get(remembered_as)
            if verdict is None or self._clock() >= verdict.until:
                verdict = self._verdict_of(token, remembered_as)
        facts.identity = verdict
        return verdict

    def pending(self, facts: Any) -> asyncio.Future[None] | None:
        """A fetch of the key set that this request's token needs (its ``kid`` is new), if
        one may run now; the proxy waits for it at most ``jwks_timeout``."""
        if self.jwks is None or not self.verdict(facts).unknown_kid:
            return None
        return self.jwks.refresh()

    async def wait_for_keys(self, facts: Any, fetch: asyncio.Future[None]) -> None:
        """Wait (bounded) for ``fetch``, then verify the request's token again."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fetch), self.settings.jwks_timeout)
        facts.identity = None
        self.verdict(facts)

    def token_of(self, headers: Mapping[str, str]) -> str | None:
        value = headers.get(self._header)
        if value is not None:
            return self._token_in(value)
        if self._cookie is not None:
            return _cookie_value(headers.get("Cookie"), self._cookie)
        return None

    def _token_in(self, value: str) -> str | None:
        """The token a value of the header carries (``Bearer`` and the token in
        ``Authorization``), or None."""
        if not self._bearer:
            return value.strip() or None
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None

    def _without_token(self) -> TokenVerdict:
        choice = self.settings.on_missing
        if choice == "anonymous":
            return ANONYMOUS
        return self._refuse("missing", "the request carries no token", choice)

    def _verdict_of(self, token: str, remembered_as: str | tuple[str]) -> TokenVerdict:
        """Verify ``token`` and remember the verdict as ``remembered_as`` (not one waiting for
        an unknown kid)."""
        now = self._clock()
        settings = self.settings
        try:
            parts, until = self._verify_now(token, now)
            verdict = TokenVerdict(parts, until=until)
        except _Invalid as invalid:
            unknown_kid = invalid.cause == "unknown_kid"
            if not unknown_kid and self._throttle.due(invalid.cause):
                self._throttle.log(logging.INFO, invalid.cause, f"jwt refused: {invalid.detail}")
            if settings.on_invalid == "anonymous":
                verdict = TokenVerdict(None, unknown_kid=unknown_kid)
            else:
                verdict = self._refuse(invalid.cause, invalid.detail, settings.on_invalid)
                verdict.unknown_kid = unknown_kid
            if unknown_kid:
                return verdict
            verdict.until = now + REFUSED_TTL_S
        verdicts = self._verdicts
        verdicts.pop(remembered_as, None)
        if len(verdicts) >= self._cache_size:
            del verdicts[next(iter(verdicts))]  # the oldest out
        verdicts[remembered_as] = verdict
        return verdict

    @staticmethod
    def _refuse(cause: str, detail: str, choice: str) -> TokenVerdict:
        refusal = TokenRefused(STATUS_OF[choice], f"invalid token: {detail}", cause)
        return TokenVerdict(None, refusal)

    # -- verification --

    def _verify_now(self, token: str, now: float) -> tuple[dict[str, str], float]:
        """The token's claims as key parts and the instant it stops being good; ``_Invalid``
        if it is not."""
        self.verifications += 1
        header = _header_of(token)
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or algorithm not in self._accepted:
            raise _Invalid("algorithm", f"algorithm {str(algorithm)[:20]!r} is not accepted")
        key = self._static
        if key is None:
            kid = header.get("kid")
            assert self.jwks is not None
            key = self.jwks.keys.get(kid) if isinstance(kid, str) else None
            if key is None:
                raise _Invalid("unknown_kid", f"no key {str(kid)[:40]!r} in the key set")
        try:
            if algorithm == "EdDSA":  # named so before RFC 9864; joserfc warns of the name
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SecurityWarning)
                    claims = jwt.decode(token, key, algorithms=[algorithm]).claims
            else:
                claims = jwt.decode(token, key, algorithms=[algorithm]).claims
        except (JoseError, ValueError, TypeError, KeyError, AttributeError) as exc:
            # Whatever a crafted token makes the library raise: a refusal, never a traceback.
            raise _Invalid("signature", f"not verified ({type(exc).__name__})") from None
        until = self._check_claims(claims, now)
        return {name: part for name, value in claims.items() if (part := _as_part(value))}, until

    def _check_claims(self, claims: Mapping[str, Any], now: float) -> float:
        """Check exp, nbf, iss and aud; the instant until which the token stays good."""
        settings = self.settings
        leeway = self._leeway
        exp = claims.get("exp")
        if exp is not None:
            if not _is_number(exp):
                raise _Invalid("malformed", "exp is not a number")
            if now >= exp + leeway:
                raise _Invalid("expired", "the token has expired")
        nbf = claims.get("nbf")
        if nbf is not None:
            if not _is_number(nbf):
                raise _Invalid("malformed", "nbf is not a number")
            if now + leeway < nbf:
                raise _Invalid("not_yet_valid", "the token is not valid yet (nbf)")
        if settings.issuer is not None and claims.get("iss") != settings.issuer:
            raise _Invalid("issuer", "the token's issuer is not the one expected")
        if settings.audience is not None:
            aud = claims.get("aud")
            audiences = aud if isinstance(aud, list) else [aud]
            if settings.audience not in audiences:
                raise _Invalid("audience", "the token is not for this audience")
        return float(now + NO_EXP_TTL_S if exp is None else exp + leeway)


def _as_part(value: Any) -> str | None:
    """A claim's value as a key part: a string or a number (tagged as a client's value is,
    should it hold the key's separators); ``None`` for anything else."""
    if isinstance(value, str):
        return client_value(value)
    if _is_number(value):
        return str(value)
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _header_of(token: str) -> dict[str, Any]:
    encoded, _, rest = token.partition(".")
    if not rest or rest.count(".") != 1:
        raise _Invalid("malformed", "not a compact JWS (three dot-separated parts)")
    try:
        header = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (ValueError, TypeError):
        raise _Invalid("malformed", "its header is not base64url JSON") from None
    if not isinstance(header, dict):
        raise _Invalid("malformed", "its header is not a JSON object")
    return header


def _cookie_value(header: str | None, name: str) -> str | None:
    if not header:
        return None
    for item in header.split(";"):
        key, sep, value = item.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"') or None
    return None
