"""``gateway keys``: the keys' API from the command line, over the admin listener (its
address and token found as ``gateway healthcheck`` finds them, or ``--admin URL``)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

from gateway.admin.auth import AdminAuth, AdminTokenError
from gateway.admin.healthcheck import HealthcheckError, probe_target
from gateway.policy.models import ServerSettings

CHANGES = ("reset", "block", "unblock")


class KeysCliError(Exception):
    """Why the call could not be made or was refused: one line, exit 1."""


def add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "show", *CHANGES))
    parser.add_argument("limit", help="the limit's name")
    parser.add_argument(
        "--key", action="append", default=[], help="the key's value (once per part of a key)"
    )
    parser.add_argument("--id", help="the key's id (sha256:..., as list shows it)")
    parser.add_argument("--for", dest="duration", help="block: how long (15m, 1h)")
    parser.add_argument("--reason", help="why (required by reset, block, unblock; logged)")
    parser.add_argument("--top", type=int, default=20, help="list: keys shown (20)")
    parser.add_argument("--config", "-c", help="policy file (default: GATEWAY_CONFIG)")
    parser.add_argument("--admin", metavar="URL", help="the admin listener, e.g. http://host:9090")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds")


def run_keys(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    if args.action in CHANGES and not (args.reason or "").strip():
        print(f"gateway keys {args.action}: --reason is required (it is logged)", file=sys.stderr)
        return 2
    if args.action == "block" and not args.duration:
        print("gateway keys block: --for is required (15m, 1h)", file=sys.stderr)
        return 2
    if args.action not in ("list",) and not args.key and not args.id:
        print(f"gateway keys {args.action}: name the key: --key or --id", file=sys.stderr)
        return 2
    try:
        document = _call(args, environ)
    except (KeysCliError, HealthcheckError) as exc:
        print(f"gateway keys: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(document, indent=2))
    return 0


def _call(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    host, port, auth = _target(args, environ)
    limit = args.limit
    body: dict[str, Any] | None = None
    if args.action == "list":
        path = f"/keys/{limit}?{urlencode({'top': args.top})}"
    elif args.action == "show":
        query = [("key", k) for k in args.key] + ([("id", args.id)] if args.id else [])
        path = f"/keys/{limit}/key?{urlencode(query)}"
    else:
        path = f"/keys/{limit}/{args.action}"
        body = {"reason": args.reason}
        if args.key:
            body["key"] = args.key[0] if len(args.key) == 1 else args.key
        if args.id:
            body["id"] = args.id
        if args.duration:
            body["for"] = args.duration
    headers = {"Content-Type": "application/json"}
    if auth.token is not None:
        headers["Authorization"] = f"Bearer {auth.token}"
    connection = http.client.HTTPConnection(host, port, timeout=args.timeout)
    try:
        connection.request(
            "POST" if body is not None else "GET",
            path,
            body=json.dumps(body) if body is not None else None,
            headers=headers,
        )
        response = connection.getresponse()
        data = response.read(1 << 22)
    except (OSError, http.client.HTTPException) as exc:
        raise KeysCliError(f"{host}:{port}: {exc}") from None
    finally:
        connection.close()
    try:
        document = json.loads(data)
    except ValueError:
        document = {"error": data[:200].decode("utf-8", "replace")}
    if response.status != 200:
        error = document.get("error") if isinstance(document, dict) else None
        raise KeysCliError(f"{response.status} {response.reason}: {error or ''}".rstrip(": "))
    return document


def _target(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, int, AdminAuth]:
    if args.admin is None:
        return probe_target(args.config, environ)
    split = urlsplit(args.admin)
    if split.scheme != "http" or split.hostname is None or split.port is None:
        raise KeysCliError(f"--admin {args.admin!r}: expected http://HOST:PORT")
    try:
        auth = AdminAuth.of(ServerSettings(), environ)
    except AdminTokenError as exc:
        raise KeysCliError(str(exc)) from None
    return split.hostname, split.port, auth
