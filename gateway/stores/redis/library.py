"""The Lua the Redis store runs, as one script (``EVALSHA``) and as a function library
(``FUNCTION LOAD`` once, ``FCALL`` per call).

``EVALSHA`` runs the whole script on every call: for the decision script that is every
algorithm's definitions before a decision starts (most of a call's cost when it decides
little). A library runs the same files, but the part before ``call_header.lua`` (helpers and
algorithms) only once per loaded library (at its first call: loading may touch no global but
``redis``); each call runs ``call_header.lua`` and what follows it.
Both forms are built from the same files, so they decide bit for bit alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

_HEADER = "call_header.lua"


@dataclass(frozen=True, slots=True)
class LuaProgram:
    """One program in both forms."""

    script: str  # for SCRIPT LOAD / EVALSHA
    sha: str
    library: str  # for FUNCTION LOAD; registers ``function``
    function: str  # a name per content: replicas of other versions keep their own


def _read(name: str) -> str:
    return (resources.files("gateway.stores.redis") / "lua" / name).read_text(encoding="utf-8")


def lua_program(name: str, setup: Sequence[str], per_call: Sequence[str]) -> LuaProgram:
    """``setup`` files run once per library load, ``per_call`` ones (after the call header)
    on every call; the script runs them all, in that order, on every call."""
    setup_text = "\n".join(_read(file) for file in setup)
    call_text = "\n".join(_read(file) for file in (_HEADER, *per_call))
    script = f"{setup_text}\n{call_text}"
    sha = hashlib.sha1(script.encode()).hexdigest()
    function = f"gateway_{name}_{sha[:16]}"
    # Loading a library may touch no global but ``redis`` (no math, string, struct): the
    # setup runs at the first call, and its closure serves every call after it.
    library = (
        f"#!lua name={function}\nlocal call\nlocal function build()\n{setup_text}\n"
        f"return function(KEYS, ARGV)\n{call_text}\nend\nend\n"
        f"redis.register_function('{function}', function(KEYS, ARGV)\n"
        "  if not call then call = build() end\n  return call(KEYS, ARGV)\nend)\n"
    )
    return LuaProgram(script, sha, library, function)
