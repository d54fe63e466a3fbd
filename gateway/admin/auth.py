"""Bearer-token authentication of the admin listener.

Scripts send ``Authorization: Bearer TOKEN``. A browser signs in once on ``/login`` (a form
POST, so the token never sits in a URL, a proxy's access log or the browser history) and gets
an HttpOnly, SameSite=Strict cookie holding an HMAC of the token, not the token; the cookie
opens GET and HEAD requests only, so ``POST /reload`` always needs the header. Tokens and
cookies are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.policy.models import ServerSettings

if TYPE_CHECKING:  # aiohttp is imported where it is used: `gateway healthcheck` needs none
    from aiohttp import web
    from aiohttp.typedefs import Middleware

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ENV_TOKEN = "GATEWAY_ADMIN_TOKEN"
ENV_TOKEN_FILE = "GATEWAY_ADMIN_TOKEN_FILE"
# Where `gateway run` writes a random token (keeping the one the file holds) when its admin
# listener is off loopback and none is given: the image's default, so `docker run IMAGE` has a
# token as a Kubernetes pod has its service-account token.
ENV_TOKEN_AUTO_FILE = "GATEWAY_ADMIN_TOKEN_AUTO_FILE"
MIN_TOKEN_LENGTH = 16
COOKIE = "gateway_admin"
LOGIN_PATH = "/login"
_SESSION_LABEL = b"gateway admin session v1"


class AdminTokenError(ValueError):
    """The configured token cannot be used (unreadable file, too short): refuse to start."""


def resolve_admin_token(
    settings: ServerSettings, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The admin token in force: ``GATEWAY_ADMIN_TOKEN``, else the file named by
    ``GATEWAY_ADMIN_TOKEN_FILE`` or ``server.admin_token_file``, else ``server.admin_token``.
    ``None``: the admin listener is open (the default, for loopback-only admin ports)."""
    token = environ.get(ENV_TOKEN) or None
    source = ENV_TOKEN
    if token is None:
        path = environ.get(ENV_TOKEN_FILE) or settings.admin_token_file
        if path:
            source = f"admin token file {path}"
            try:
                token = Path(path).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise AdminTokenError(f"{source}: cannot read it: {reason}") from None
            if not token:
                raise AdminTokenError(f"{source}: the file is empty")
        else:
            token, source = settings.admin_token, "server.admin_token"
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise AdminTokenError(
            f"{source}: the admin token is shorter than {MIN_TOKEN_LENGTH} characters"
        )
    return token


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost. A wildcard (0.0.0.0, ::) is every interface, not this."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def open_admin_refusal(
    listen: tuple[str, int], source: str, token: str | None, settings: ServerSettings
) -> str | None:
    """Why an admin listener may not start: off loopback with no token, anyone who reaches it
    could read the policy and reload it. ``server.admin_insecure`` accepts that, as Traefik's
    ``api.insecure`` does for its dashboard. ``source`` says where ``listen`` was given."""
    host, port = listen
    if token is not None or settings.admin_insecure or is_loopback(host):
        return None
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return (
        f"the admin listener on {address} ({source}) is off loopback and has no admin token: "
        "anyone who reaches it could read the policy and reload it; give it a token "
        f"({ENV_TOKEN}, {ENV_TOKEN_FILE} or server.admin_token_file; `gateway admin-token FILE` "
        "writes one), or listen on 127.0.0.1, or write server.admin_insecure: true to serve it "
        "open"
    )


@dataclass(frozen=True, slots=True)
class AdminAuth:
    """The token and the paths open without it; replaced whole when a reload changes them."""

    token: str | None = None
    public_paths: tuple[str, ...] = ("/healthz", "/readyz", "/metrics")

    @classmethod
    def of(cls, settings: ServerSettings, environ: Mapping[str, str] = os.environ) -> AdminAuth:
        return cls(resolve_admin_token(settings, environ), settings.admin_public_paths)

    def is_public(self, path: str) -> bool:
        if self.token is None or path == LOGIN_PATH:
            return True
        for public in self.public_paths:
            if path == public or (public == "/dashboard" and path.startswith("/dashboard/")):
                return True
        return False

    def session_value(self) -> str:
        """What the browser's cookie holds: an HMAC of the token, so the cookie is not the
        token, and changing the token signs every browser out."""
        assert self.token is not None
        return hmac.new(self.token.encode(), _SESSION_LABEL, hashlib.sha256).hexdigest()

    def token_matches(self, offered: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(offered.encode(), self.token.encode())

    def allows(self, request: web.BaseRequest) -> bool:
        if self.is_public(request.path):
            return True
        scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credential:
            return self.token_matches(credential.strip())
        cookie = request.cookies.get(COOKIE)
        if cookie and request.method in ("GET", "HEAD"):
            return hmac.compare_digest(cookie.encode(), self.session_value().encode())
        return False


def auth_middleware(current: Callable[[], AdminAuth]) -> Middleware:
    """Refuse requests without the token (401; a browser asking for a page goes to /login)."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if current().allows(request):
            return await handler(request)
        if request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
            raise web.HTTPSeeOther(LOGIN_PATH)
        return web.json_response(
            {"error": "admin token required: send Authorization: Bearer TOKEN"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="gateway admin"'},
        )

    return middleware


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gateway admin: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font-family: system-ui, sans-serif; max-width: 28rem; margin: 4rem auto">
<h1>gateway admin</h1>{message}
<form method="post" action="/login">
<label>Admin token <input type="password" name="token" autocomplete="current-password"
 autofocus required></label> <button type="submit">Sign in</button>
</form></body></html>
"""


def _login_page(message: str = "", status: int = 200) -> web.Response:
    from aiohttp import web

    shown = f"<p role=alert>{html.escape(message)}</p>" if message else ""
    text = _LOGIN_PAGE.format(message=shown)
    return web.Response(
        text=text, status=status, content_type="text/html", headers={"Cache-Control": "no-store"}
    )


def login_routes(current: Callable[[], AdminAuth]) -> list[web.RouteDef]:
    from aiohttp import web

    async def login_form(request: web.Request) -> web.StreamResponse:
        if current().token is None:
            raise web.HTTPSeeOther("/dashboard/")
        return _login_page()

    async def login(request: web.Request) -> web.StreamResponse:
        auth = current()
        if auth.token is None:
            raise web.HTTPSeeOther("/dashboard/")
        form = await request.post()
        offered = form.get("token")
        if not isinstance(offered, str) or not auth.token_matches(offered.strip()):
            return _login_page("That is not the admin token.", status=401)
        response = web.Response(status=303, headers={"Location": "/dashboard/"})
        # No Secure flag: the admin listener speaks plain HTTP (keep it on loopback or a
        # private network, or put TLS in front and let that proxy add the flag).
        response.set_cookie(
            COOKIE, auth.session_value(), httponly=True, samesite="Strict", path="/"
        )
        return response

    return [web.get(LOGIN_PATH, login_form), web.post(LOGIN_PATH, login)]
