"""What ``run`` and ``check`` find out about the listen addresses before anything serves.

``run`` refuses to start while another gateway holds an address it would listen on. With
``--workers N`` every worker binds with SO_REUSEPORT, and so would a second gateway's: the
kernel would share the port between both, each admitting a whole limit from its own state,
and nothing would fail. So before anything binds, each address is locked: an abstract Unix
socket named after it (Linux), scoped to the network namespace as the port itself is, and
released by the kernel when the last process holding it exits, so a gateway killed with
SIGKILL leaves no stale lock. The supervisor takes it and its workers inherit it: it is held
until the last of them is gone, orphans included. Then the address is bound once without
SO_REUSEPORT, which fails while any other program listens there (as nginx's bind would).

``check`` binds each address as ``nginx -t`` does: an address on no local interface is
refused; one in use is not (the gateway being checked may be the one holding it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

LOCK_PREFIX: Final = "gateway/listen/"


class AddressHeld(Exception):
    """Another gateway, or another program, holds a listen address: one line, why."""


def display(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolved(host: str, port: int) -> list[tuple[socket.AddressFamily, Any]]:
    """The socket families and addresses ``host`` binds as (asyncio binds every one)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return [(family, address) for family, _, _, _, address in infos]


def bind_error(host: str, port: int) -> OSError | None:
    """Bind ``host:port`` as the listener would (SO_REUSEADDR, no SO_REUSEPORT) and close it
    at once: the error, or None. A name that does not resolve is an error too."""
    try:
        addresses = _resolved(host, port)
    except socket.gaierror as exc:
        return exc
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return exc
    return None


def reason(exc: OSError) -> str:
    """An errno's text as the listener's refusal says it (``address already in use``)."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host ({exc.strerror})"
    if exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc)


def check_problem(host: str, port: int) -> str | None:
    """``gateway check``'s word on a listen address: refused only if ``run`` could never
    bind it here (no local interface has the address, a name that does not resolve, a
    privileged port), never for being in use."""
    exc = bind_error(host, port)
    if exc is None or exc.errno == errno.EADDRINUSE:
        return None
    text = f"cannot listen on {display(host, port)}: {reason(exc)}"
    if exc.errno == errno.EADDRNOTAVAIL:
        text += " (no local interface has this address)"
    return text


@contextlib.contextmanager
def held(addresses: list[tuple[str, str, int]]) -> Iterator[None]:
    """Lock each ``(what, host, port)`` (port 0 needs none) and check nothing else listens
    there; raises ``AddressHeld``. The locks are kept open until the block ends, and are
    inherited by the processes forked meanwhile."""
    locks: list[socket.socket] = []
    try:
        for what, host, port in addresses:
            if port == 0:
                continue
            where = display(host, port)
            lock = _lock(f"{LOCK_PREFIX}{where.lower()}")
            if lock is None:
                holders = _holders(f"{LOCK_PREFIX}{where.lower()}")
                pids = f" (pid {', '.join(map(str, holders))})" if holders else ""
                raise AddressHeld(
                    f"cannot listen on {where} ({what}): another gateway still runs there"
                    f"{pids}; stop it first"
                )
            locks.append(lock)
            exc = bind_error(host, port)
            if exc is not None:
                raise AddressHeld(f"cannot listen on {where} ({what}): {reason(exc)}")
        yield
    finally:
        for lock in locks:
            lock.close()


def _lock(name: str) -> socket.socket | None:
    """The abstract socket ``name`` bound, or None if a process holds it already."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(b"\0" + name.encode())
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return lock


def _holders(name: str) -> list[int]:
    """The processes holding the abstract socket ``name``, as far as /proc shows them (for
    the message only: another user's processes may not be listed)."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == "@" + name:
                inodes.add(f"socket:[{fields[6]}]")
    pids: list[int] = []
    if not inodes:
        return pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                        pids.append(int(entry))
                        break
    return sorted(pids)
