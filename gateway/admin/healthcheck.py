"""``gateway healthcheck``: the container's probe of its own admin listener.

The address comes from where the gateway reads it (``GATEWAY_ADMIN_LISTEN``, else the policy's
``server.admin_listen``), so the image's ``HEALTHCHECK`` follows a changed port; a wildcard
address is probed on loopback, and the admin token is sent when the probed path needs it (the
one ``run`` made in ``GATEWAY_ADMIN_TOKEN_AUTO_FILE`` when none was given).
"""

from __future__ import annotations

import http.client
import os
from collections.abc import Mapping

from gateway.admin.auth import (
    ENV_TOKEN_AUTO_FILE,
    ENV_TOKEN_FILE,
    AdminAuth,
    AdminTokenError,
    open_admin_refusal,
)
from gateway.policy.loader import PolicyError, load_policy
from gateway.policy.models import ServerSettings, split_host_port

ENV_CONFIG = "GATEWAY_CONFIG"
ENV_ADMIN_LISTEN = "GATEWAY_ADMIN_LISTEN"
_WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class HealthcheckError(Exception):
    """Why the probe could not be made or failed: one line, exit 1."""


def probe_target(
    config: str | None, environ: Mapping[str, str] = os.environ
) -> tuple[str, int, AdminAuth]:
    """Host, port and auth settings of the admin listener to probe."""
    config = config or environ.get(ENV_CONFIG) or None
    listen = environ.get(ENV_ADMIN_LISTEN) or None
    settings = ServerSettings()
    if config is not None:
        try:
            settings = load_policy(config).policy.server
        except PolicyError as exc:
            # With the address from the environment an invalid file does not matter here: the
            # running gateway keeps its last good policy, and its health is what is asked.
            if listen is None:
                first = str(exc).splitlines()[0]
                raise HealthcheckError(f"cannot read the admin address: {first}") from None
    try:
        host, port = split_host_port(listen or settings.admin_listen)
    except ValueError as exc:
        raise HealthcheckError(f"{ENV_ADMIN_LISTEN}: {exc}") from None
    try:
        auth = AdminAuth.of(settings, environ)
        made = environ.get(ENV_TOKEN_AUTO_FILE) or None
        refused = open_admin_refusal((host, port), "", auth.token, settings)
        if made and refused is not None and os.path.isfile(made):
            # `run` made its token there (this probe is another process: not told so).
            auth = AdminAuth.of(settings, {**environ, ENV_TOKEN_FILE: made})
    except AdminTokenError as exc:
        raise HealthcheckError(str(exc)) from None
    return _WILDCARD.get(host, host), port, auth


def healthcheck(
    config: str | None,
    path: str = "/readyz",
    timeout_s: float = 2.0,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """Probe ``path``; returns a line for a 200, raises ``HealthcheckError`` otherwise."""
    host, port, auth = probe_target(config, environ)
    headers = {}
    if not auth.is_public(path) and auth.token is not None:
        headers["Authorization"] = f"Bearer {auth.token}"
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    url = f"http://{shown}{path}"
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        response.read(4096)
    except (OSError, http.client.HTTPException) as exc:
        reason = (
            exc.strerror
            if isinstance(exc, OSError) and exc.strerror
            else str(exc) or type(exc).__name__
        )
        raise HealthcheckError(f"{url}: {reason}") from None
    finally:
        connection.close()
    if response.status != 200:
        raise HealthcheckError(f"{url}: {response.status} {response.reason}")
    return f"{url}: {response.status} {response.reason}"
