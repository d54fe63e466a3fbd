"""Policy texts the tests start gateways with, and writing a policy file the way an editor or
a ConfigMap swap does."""

from __future__ import annotations

import os
from pathlib import Path


def policy_for(upstream_url: str, extra: str = "", server: str = "") -> str:
    """A policy text with one upstream ``backend`` and a catch-all route."""
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n    connect_timeout: 2s\n"
        "    read_timeout: 5s\n"
        "routes:\n  - name: all\n    upstream: backend\n" + extra
    )


def limited_policy(upstream_url: str, limits: str, server: str = "") -> str:
    return policy_for(upstream_url, server=server) + "limits:\n" + limits


def policy_template(upstream_url: str, server: str = "") -> str:
    """A policy for a gateway process; ``{port}`` and ``{admin_port}`` are filled in with
    free ports when it starts."""
    return (
        "server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        + server
        + f"upstreams:\n  backend:\n    url: {upstream_url}\n    read_timeout: 60s\n"
        "routes:\n  - name: all\n    upstream: backend\n"
    )


PER_IP_BURST_4 = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 4\n    nodelay: true\n"
)


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once (a rename), so a watcher never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
