"""A network namespace of the test's own (``unshare -n``, as root): its loopback device up and
holding 10.77.0.1, an address off loopback, so a gateway can listen there and be asked over
HTTP with no packet leaving the machine (nothing else is in the namespace). The gateway runs
in it; each request is sent from inside it by a short Python client (``nsenter``)."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import subprocess
import sys

import pytest

ADDRESS = "10.77.0.1"  # off loopback, on the namespace's own loopback device
_SETUP = f'ip link set lo up && ip addr add {ADDRESS}/32 dev lo && exec "$@"'

_CLIENT = """
import json, sys, urllib.error, urllib.request
method, url, headers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
request = urllib.request.Request(url, method=method, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=5) as resp:
        print(resp.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


@functools.cache
def available() -> bool:
    """Whether this machine lets the tests make a network namespace (root, util-linux)."""
    if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip")):
        return False
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", _SETUP, "sh", "true"], capture_output=True, timeout=10
    )
    return probe.returncode == 0


def need_netns() -> None:
    if not available():
        pytest.skip("needs a network namespace of its own (unshare -n as root)")


def in_new_netns(*cmd: str) -> list[str]:
    """``cmd`` run in a new network namespace holding ``ADDRESS``: the process keeps its pid
    (``unshare`` and ``sh`` exec it), so ``request`` can enter its namespace."""
    return ["unshare", "-n", "sh", "-c", _SETUP, "sh", *cmd]


async def request(pid: int, method: str, url: str, headers: dict[str, str] | None = None) -> int:
    """The HTTP status ``url`` answers, asked from inside the namespace of process ``pid``."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter", "-t", str(pid), "-n",
        sys.executable, "-c", _CLIENT, method, url, json.dumps(headers or {}),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    return int(out)
