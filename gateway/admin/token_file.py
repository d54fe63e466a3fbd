"""``gateway admin-token FILE``: put an admin token where ``GATEWAY_ADMIN_TOKEN_FILE`` reads it,
so a deployment example can turn the token on without a secret being made first.

The token is the one in ``--from`` (a mounted secret) when that file exists, else the one FILE
already holds (``--keep``: a volume that outlives the container), else a new random one. FILE is
written with mode 0600; the token is never printed.

``GATEWAY_ADMIN_TOKEN_AUTO_FILE`` (the image sets it) has ``gateway run`` do the same, keeping
the token the file holds, when its admin listener is off loopback and no token is given: what
would otherwise be refused then starts with a token, read from that file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from gateway.admin.auth import (
    ENV_TOKEN_AUTO_FILE,
    MIN_TOKEN_LENGTH,
    AdminTokenError,
    open_admin_refusal,
    resolve_admin_token,
)
from gateway.policy.models import ServerSettings


class TokenFileError(ValueError):
    """A given token that cannot be used, or a file that cannot be written."""


def write_token_file(path: str, given: str | None = None, *, keep: bool = False) -> str:
    """Write the token; says where it came from (``given``, ``kept`` or ``new``)."""
    token, origin = "", "new"
    if given is not None and os.path.isfile(given):
        token, origin = _read(given), "given"
        if len(token) < MIN_TOKEN_LENGTH:
            raise TokenFileError(
                f"{given}: the admin token is shorter than {MIN_TOKEN_LENGTH} characters"
            )
    elif keep and os.path.isfile(path):
        token, origin = _read(path), "kept"
        if len(token) < MIN_TOKEN_LENGTH:
            token, origin = "", "new"
    if not token:
        token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot write it: {exc.strerror or exc}") from None
    return origin


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"{path}: cannot read it: {exc}") from None


def auto_token_file(
    settings: ServerSettings, admin: tuple[str, int], environ: Mapping[str, str] = os.environ
) -> str | None:
    """The file ``GATEWAY_ADMIN_TOKEN_AUTO_FILE`` names when ``run`` would make its token
    there: the admin listener would be refused for want of one. ``None``: nothing to make (a
    token is given, the listener is on loopback, or an unusable token ``run`` reports)."""
    path = environ.get(ENV_TOKEN_AUTO_FILE) or None
    if path is None:
        return None
    try:
        token = resolve_admin_token(settings, environ)
    except AdminTokenError:
        return None
    return path if open_admin_refusal(admin, "", token, settings) is not None else None
