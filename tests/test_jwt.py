"""JWT identities end to end: tokens made here with joserfc's signer, verified by the real
gateway (a real upstream, real clients over loopback), a JWKS served by a real aiohttp server
whose keys rotate mid-run; refused tokens (expired, wrong audience, ``alg: none``, HS/RS
confusion) and the policy's mistakes in its own words."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from joserfc import jwt
from joserfc.errors import SecurityWarning
from joserfc.jwk import ECKey, OctKey, OKPKey, RSAKey

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build, parse_and_build
from gateway.limits.keys import RequestFacts
from gateway.limits.token_verifier import TokenVerifier
from gateway.policy.identity import JwtSettings
from gateway.policy.loader import PolicyError
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream

# The gateway's calendar time in these tests: the fake clock's, a fixed instant.
NOW_S = 1_800_000_000
SECRET = b"0123456789abcdef0123456789abcdef-test-secret"


def _clock() -> FakeClock:
    return FakeClock(start_us=0, unix_offset_us=NOW_S * 1_000_000)


def _hs(claims: dict[str, Any], secret: bytes = SECRET) -> str:
    return jwt.encode({"alg": "HS256"}, claims, OctKey.import_key(secret))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(claims: dict[str, Any]) -> str:
    """A token with ``alg: none`` and no signature."""
    header = _b64(b'{"alg":"none"}')
    return f"{header}.{_b64(json.dumps(claims).encode())}."


def _hmac_signed(claims: dict[str, Any], secret: bytes) -> str:
    """HS256 signed with ``secret`` by hand (the public-key confusion: a PEM as the secret)."""
    header = _b64(b'{"alg":"HS256"}')
    signing = f"{header}.{_b64(json.dumps(claims).encode())}"
    signature = hmac.new(secret, signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{_b64(signature)}"


def _hmac_signed_with_header(header: bytes, claims: dict[str, Any] | None) -> str:
    """Signed with the right secret, but its header or claims are not what they should be."""
    payload = json.dumps(claims).encode() if claims is not None else b"not json"
    signing = f"{_b64(header)}.{_b64(payload)}"
    signature = hmac.new(SECRET, signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{_b64(signature)}"


def _limits(key: str = "[jwt:sub]", extra: str = "") -> str:
    return (
        "limits:\n  per_user:\n    algorithm: fixed_window\n    limit: 2\n    window: 1h\n"
        f"    key: {key}\n{extra}"
    )


def _jwt_section(source: str, extra: str = "") -> str:
    return f"jwt:\n  {source}\n  audience: api\n  issuer: https://issuer.test\n{extra}"


def _claims(sub: str, **more: Any) -> dict[str, Any]:
    return {
        "sub": sub,
        "aud": "api",
        "iss": "https://issuer.test",
        "exp": NOW_S + 3600,
        **more,
    }


async def _status(
    session: aiohttp.ClientSession, url: str, token: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.get(url + "/", headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "jwt.secret"
    path.write_bytes(SECRET + b"\n")
    return path


async def test_a_claim_keys_the_limit_and_bad_tokens_get_401(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, secret_file: Path
) -> None:
    policy = policy_for(upstream.url, _limits() + _jwt_section(f"secret_file: {secret_file}"))
    gw = await start_gateway(policy, clock=_clock())
    alice, bob = _hs(_claims("alice")), _hs(_claims("bob"))
    async with aiohttp.ClientSession() as session:
        statuses = [(await _status(session, gw.url, alice))[0] for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert (await _status(session, gw.url, bob))[0] == 200  # a key of its own
        refused = {
            "expired": _hs(_claims("alice", exp=NOW_S - 60)),
            "wrong audience": _hs(_claims("carol", aud="other")),
            "wrong issuer": _hs(_claims("carol", iss="https://evil.test")),
            "not yet valid": _hs(_claims("carol", nbf=NOW_S + 600)),
            "alg none": _unsigned(_claims("carol")),
            "another secret": _hs(_claims("carol"), b"x" * 40),
            "garbage": "not.a.token",
            "alg as a list": _hmac_signed_with_header(b'{"alg":["HS256"]}', _claims("c")),
            "claims not json": _hmac_signed_with_header(b'{"alg":"HS256"}', None),
        }
        for what, token in refused.items():
            status, headers, body = await _status(session, gw.url, token)
            assert status == 401, what
            assert headers["WWW-Authenticate"].startswith("Bearer"), what
            assert token not in body.decode(), what
        # Within the leeway (30 s): an expiry 10 s ago is still good.
        assert (await _status(session, gw.url, _hs(_claims("dave", exp=NOW_S - 10))))[0] == 200
        # No token: anonymous by default, and the limit's key part is missing (skip).
        assert [(await _status(session, gw.url))[0] for _ in range(3)] == [200] * 3


async def test_missing_token_policies(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, secret_file: Path
) -> None:
    anonymous_by_ip = policy_for(
        upstream.url,
        _limits(extra="    on_missing_key: client_ip\n")
        + _jwt_section(f"secret_file: {secret_file}"),
    )
    refusing = policy_for(
        upstream.url,
        _limits() + _jwt_section(f"secret_file: {secret_file}", "  on_missing: 401\n"),
    )
    rejecting = policy_for(
        upstream.url,
        _limits() + _jwt_section(f"secret_file: {secret_file}", "  on_invalid: reject\n"),
    )
    by_ip = await start_gateway(anonymous_by_ip, clock=_clock())
    needs_token = await start_gateway(refusing, clock=_clock())
    forbids = await start_gateway(rejecting, clock=_clock())
    async with aiohttp.ClientSession() as session:
        assert [(await _status(session, by_ip.url))[0] for _ in range(3)] == [200, 200, 429]
        assert (await _status(session, needs_token.url))[0] == 401
        assert (await _status(session, needs_token.url, _hs(_claims("a"))))[0] == 200
        assert (await _status(session, forbids.url, _unsigned(_claims("a"))))[0] == 403


async def test_plan_from_a_claim(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, secret_file: Path
) -> None:
    limits = _limits(extra="    plan_from: {jwt: tier}\n    plans:\n      gold: {limit: 4}\n")
    gw = await start_gateway(
        policy_for(upstream.url, limits + _jwt_section(f"secret_file: {secret_file}")),
        clock=_clock(),
    )
    tokens = {
        "gold": _hs(_claims("g", tier="gold")),
        "unknown plan": _hs(_claims("u", tier="platinum")),
        "no plan": _hs(_claims("n")),
    }
    async with aiohttp.ClientSession() as session:
        admitted = {}
        for what, token in tokens.items():
            statuses = [(await _status(session, gw.url, token))[0] for _ in range(5)]
            admitted[what] = statuses.count(200)
            if what == "gold":
                headers = (await _status(session, gw.url, token))[1]
                assert headers["RateLimit-Policy"] == '"per_user";q=4;w=3600'
        assert admitted == {"gold": 4, "unknown plan": 2, "no plan": 2}


async def test_rs256_pem_refuses_hs256_made_with_the_public_key(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    private = RSAKey.generate_key(2048)
    pem = private.as_pem(private=False)
    (tmp_path / "public.pem").write_bytes(pem)
    policy = policy_for(
        upstream.url, _limits() + _jwt_section(f"public_key_file: {tmp_path / 'public.pem'}")
    )
    gw = await start_gateway(policy, clock=_clock())
    good = jwt.encode({"alg": "RS256"}, _claims("alice"), private)
    confused = _hmac_signed(_claims("mallory"), pem)
    async with aiohttp.ClientSession() as session:
        assert (await _status(session, gw.url, good))[0] == 200
        assert (await _status(session, gw.url, confused))[0] == 401


@pytest.mark.parametrize("kind", ["ES256", "Ed25519", "EdDSA"])
def test_ec_and_ed25519_public_keys(tmp_path: Path, kind: str) -> None:
    private = ECKey.generate_key("P-256") if kind == "ES256" else OKPKey.generate_key("Ed25519")
    (tmp_path / "public.pem").write_bytes(private.as_pem(private=False))
    settings = JwtSettings(public_key_file=str(tmp_path / "public.pem"))
    verifier = TokenVerifier(settings, wall_clock=lambda: NOW_S)
    with warnings.catch_warnings():  # EdDSA: the name RFC 9864 deprecates, still accepted
        warnings.simplefilter("ignore", SecurityWarning)
        claims = {"sub": "k", "exp": NOW_S + 60}
        token = jwt.encode({"alg": kind}, claims, private, algorithms=[kind])
    assert verifier.claim(_facts(token), "sub") == "k"


def _facts(token: str | None) -> RequestFacts:
    from multidict import CIMultiDict, CIMultiDictProxy

    headers = CIMultiDict({"Authorization": f"Bearer {token}"} if token else {})
    return RequestFacts.of("127.0.0.1", 64, "all", "GET", CIMultiDictProxy(headers), dict)


def test_a_token_seen_before_is_not_verified_again_until_it_expires(secret_file: Path) -> None:
    now = [float(NOW_S)]
    verifier = TokenVerifier(
        JwtSettings(secret_file=str(secret_file), cache_size=2), wall_clock=lambda: now[0]
    )
    token = _hs({"sub": "a", "exp": NOW_S + 100})
    for _ in range(5):
        assert verifier.claim(_facts(token), "sub") == "a"
    assert verifier.verifications == 1
    # Two other tokens push it out of a table of two: verified again.
    for sub in ("b", "c"):
        verifier.claim(_facts(_hs({"sub": sub, "exp": NOW_S + 100})), "sub")
    verifier.claim(_facts(token), "sub")
    assert verifier.verifications == 4
    # Past its exp (and the leeway) it is no longer good, cached or not.
    now[0] = NOW_S + 131
    facts = _facts(token)
    with pytest.raises(Exception, match="expired"):
        verifier.claim(facts, "sub")


def test_a_bearer_token_after_several_spaces_is_the_same_token(secret_file: Path) -> None:
    """RFC 6750 allows one or more spaces after ``Bearer``: the token is the same, verified
    once, and remembered by the header's value as sent (each spelling its own entry, found
    before anything is sliced or stripped)."""
    from multidict import CIMultiDict, CIMultiDictProxy

    verifier = TokenVerifier(JwtSettings(secret_file=str(secret_file)), wall_clock=lambda: NOW_S)
    token = _hs({"sub": "a", "exp": NOW_S + 100})

    def facts(value: str) -> RequestFacts:
        headers = CIMultiDictProxy(CIMultiDict({"Authorization": value}))
        return RequestFacts.of("127.0.0.1", 64, "all", "GET", headers, dict)

    read = verifier.part("sub")
    for value in (f"Bearer  {token}", f"bearer {token}", f"Bearer {token}") * 2:
        assert read(facts(value)) == "a"
    assert verifier.verifications == 3  # one per spelling, then each found as sent


# -- a JWKS served by a real server, its keys rotated mid-run --


class KeyServer:
    def __init__(self) -> None:
        self.keys: list[RSAKey] = []
        self.fetches = 0
        self.failing = False
        self.url = ""

    def document(self) -> dict[str, Any]:
        return {"keys": [key.as_dict(private=False) for key in self.keys]}


@pytest.fixture
async def key_server() -> AsyncIterator[KeyServer]:
    served = KeyServer()

    async def handle(request: web.Request) -> web.Response:
        served.fetches += 1
        if served.failing:
            return web.Response(status=500)
        return web.json_response(served.document())

    app = web.Application()
    app.router.add_get("/jwks.json", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    served.url = f"http://127.0.0.1:{port}/jwks.json"
    yield served
    await runner.cleanup()


async def test_jwks_rotation_fetches_a_new_kid_once_and_keeps_the_last_good_set(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, key_server: KeyServer
) -> None:
    first = RSAKey.generate_key(2048, parameters={"kid": "k1"})
    second = RSAKey.generate_key(2048, parameters={"kid": "k2"})
    key_server.keys = [first]
    policy = policy_for(
        upstream.url,
        _limits()
        + _jwt_section(
            f"jwks_url: {key_server.url}", "  jwks_min_refresh: 0s\n  jwks_timeout: 5s\n"
        ),
    )
    gw = await start_gateway(policy, clock=_clock())

    def token(key: RSAKey, sub: str) -> str:
        return jwt.encode({"alg": "RS256", "kid": key.kid}, _claims(sub), key)

    async with aiohttp.ClientSession() as session:
        assert (await _status(session, gw.url, token(first, "a")))[0] == 200
        fetched = key_server.fetches
        assert fetched == 1  # at start (or for the first token): once
        # Rotation: the new key published beside the old one.
        key_server.keys = [first, second]
        for sub in ("b", "c", "d"):
            assert (await _status(session, gw.url, token(second, sub)))[0] == 200
        assert key_server.fetches == fetched + 1  # the new kid fetched once
        assert (await _status(session, gw.url, token(first, "e")))[0] == 200  # old still good
        # The URL fails: the last good set is kept.
        key_server.failing = True
        third = RSAKey.generate_key(2048, parameters={"kid": "k3"})
        assert (await _status(session, gw.url, token(third, "f")))[0] == 401
        assert (await _status(session, gw.url, token(second, "g")))[0] == 200
        # The old key removed: its tokens are refused once the set is fetched again.
        key_server.failing = False
        key_server.keys = [second, third]
        assert (await _status(session, gw.url, token(third, "h")))[0] == 200
        assert (await _status(session, gw.url, token(first, "a")))[0] == 401


async def test_jwks_refresh_is_rate_limited(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, key_server: KeyServer
) -> None:
    known = RSAKey.generate_key(2048, parameters={"kid": "k1"})
    key_server.keys = [known]
    policy = policy_for(
        upstream.url,
        _limits() + _jwt_section(f"jwks_url: {key_server.url}", "  jwks_min_refresh: 1h\n"),
    )
    gw = await start_gateway(policy, clock=_clock())
    async with aiohttp.ClientSession() as session:
        good = jwt.encode({"alg": "RS256", "kid": "k1"}, _claims("a"), known)
        assert (await _status(session, gw.url, good))[0] == 200
        fetched = key_server.fetches
        for n in range(5):  # unknown kids, made up by a client: no fetch each
            stranger = RSAKey.generate_key(2048, parameters={"kid": f"x{n}"})
            forged = jwt.encode({"alg": "RS256", "kid": f"x{n}"}, _claims("m"), stranger)
            assert (await _status(session, gw.url, forged))[0] == 401
        assert key_server.fetches == fetched


# -- the policy's mistakes, in its own words --


@pytest.mark.parametrize(
    ("jwt_section", "key", "expected"),
    [
        ("", "[jwt:sub]", "limits.per_user.key: jwt:sub reads the request's token: configure jwt"),
        (
            "jwt:\n  secret_file: {short}\n",
            "[jwt:sub]",
            "jwt.secret_file: the secret is 5 bytes: HS256 needs at least 32",
        ),
        (
            "jwt:\n  secret_file: {secret}\n  jwks_url: http://127.0.0.1:1/k\n",
            "[jwt:sub]",
            "name one key source",
        ),
        (
            "jwt:\n  jwks_url: http://127.0.0.1:1/k\n  algorithms: [HS256]\n",
            "[jwt:sub]",
            "algorithm HS256 cannot be verified with jwks_url",
        ),
        (
            "jwt:\n  secret_file: {secret}\n  algorithms: [RS256]\n",
            "[jwt:sub]",
            "algorithm RS256 cannot be verified with secret_file",
        ),
        (
            "jwt:\n  public_key_file: {secret}\n",
            "[jwt:sub]",
            "jwt.public_key_file: not a PEM public key",
        ),
    ],
)
def test_policy_mistakes(
    tmp_path: Path, secret_file: Path, jwt_section: str, key: str, expected: str
) -> None:
    (tmp_path / "short").write_bytes(b"short")
    text = policy_for("http://127.0.0.1:9", _limits(key)) + jwt_section.format(
        short=tmp_path / "short", secret=secret_file
    )
    with pytest.raises(PolicyError) as raised:
        parse_and_build(text, "test.yaml")
    assert expected in raised.value.format()


def test_plan_from_with_overrides_is_refused(secret_file: Path) -> None:
    limits = _limits(
        extra="    plan_from: {jwt: tier}\n    plans:\n      gold: {limit: 4}\n"
        "    overrides:\n      a: gold\n"
    )
    text = policy_for("http://127.0.0.1:9", limits) + f"jwt:\n  secret_file: {secret_file}\n"
    with pytest.raises(PolicyError) as raised:
        parse_and_build(text, "test.yaml")
    assert "plan_from and overrides" in raised.value.format()


async def test_a_cookie_or_another_header_and_invalid_tokens_taken_as_anonymous(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, secret_file: Path
) -> None:
    extra = "  header: X-Token\n  cookie: session\n  on_invalid: anonymous\n"
    policy = policy_for(
        upstream.url,
        _limits(extra="    on_missing_key: client_ip\n")
        + _jwt_section(f"secret_file: {secret_file}", extra),
    )
    gw = await start_gateway(policy, clock=_clock())
    token = _hs(_claims("alice"))
    async with aiohttp.ClientSession() as session:

        async def status(headers: dict[str, str]) -> int:
            async with session.get(gw.url + "/", headers=headers) as response:
                return response.status

        # The header (its whole value), then the cookie: one key, alice's.
        assert await status({"X-Token": token}) == 200
        assert await status({"Cookie": f"other=1; session={token}"}) == 200
        assert await status({"X-Token": token}) == 429
        # A forged token is anonymous here: keyed by the client's address instead.
        forged = _unsigned(_claims("alice"))
        assert [await status({"X-Token": forged}) for _ in range(3)] == [200, 200, 429]
        async with session.get(
            gw.admin_url + "/explain", params={"path": "/", "header": f"X-Token: {token}"}
        ) as response:
            explained = await response.json()
        assert explained["limits"][0]["key"] == "alice"
        assert explained["verdict"]["status"] == 429


async def test_explain_names_a_refused_token(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, secret_file: Path
) -> None:
    policy = policy_for(upstream.url, _limits() + _jwt_section(f"secret_file: {secret_file}"))
    gw = await start_gateway(policy, clock=_clock())
    expired = _hs(_claims("alice", exp=NOW_S - 3600))
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            gw.admin_url + "/explain",
            params={"path": "/", "header": f"Authorization: Bearer {expired}"},
        ) as response,
    ):
        explained = await response.json()
    assert explained["verdict"]["status"] == 401
    assert "expired" in explained["limits"][0]["next_request"]["reason"]


async def test_a_reload_rotates_the_key_and_forgets_what_the_old_one_verified(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A changed ``jwt:`` section (another key file), then the key file rewritten in place
    (the policy unchanged): each reload puts the new key in force at once, and a token the
    old key verified (remembered) is refused from then on."""
    first, second, third = (SECRET, b"s" * 40, b"t" * 40)
    (tmp_path / "first.secret").write_bytes(first)
    (tmp_path / "second.secret").write_bytes(second)
    path = tmp_path / "policy.yaml"

    def write(secret_file: str) -> None:
        path.write_text(
            policy_for(upstream.url, _limits() + _jwt_section(f"secret_file: {secret_file}"))
        )

    write("first.secret")
    gw = await start_gateway(load_and_build(path), policy_path=str(path), clock=_clock())
    reloader = gw.gateway.reloader
    assert reloader is not None
    by = {name: _hs(_claims(name), secret) for name, secret in
          (("first", first), ("second", second), ("third", third))}  # fmt: skip
    async with aiohttp.ClientSession() as session:

        async def status(name: str) -> int:
            return (await _status(session, gw.url, by[name]))[0]

        assert [await status("first"), await status("second")] == [200, 401]
        write("second.secret")
        assert await reloader.reload() == "ok"
        assert [await status("first"), await status("second")] == [401, 200]
        # Rotated in place: the policy's text is the same, the reload reads the file again.
        (tmp_path / "second.secret").write_bytes(third)
        assert await reloader.reload() == "ok"
        assert [await status("second"), await status("third")] == [401, 200]
        assert await reloader.reload() == "unchanged"
