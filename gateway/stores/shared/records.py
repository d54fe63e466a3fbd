"""The shared store's bytes: a state as ``tick | state`` (16 bytes when it fits 64 bits, else
tagged), and a limit key as LMDB takes it (hashed beyond ``MAX_KEY_BYTES``)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Final

MAX_KEY_BYTES: Final = 400  # LMDB keys stop at 511 bytes: longer limit keys are hashed
TICK: Final = struct.Struct(">Q")
TICK_STATE: Final = struct.Struct(">Qq")  # a state that fits 64 bits, as almost every one does
TAGGED: Final = 1 << 63  # on the tick: the state is tagged, not packed
HELD: Final = struct.Struct(">H")  # a worker's number in its ``held`` records


def encode_payload(state: Any) -> bytes:
    """``tag | payload``: states are ints (packed by their algorithm) or bytes."""
    if isinstance(state, int):
        return b"i" + state.to_bytes((state.bit_length() + 8) // 8, "little", signed=True)
    if isinstance(state, bytes):
        return b"b" + state
    raise TypeError(f"a state of type {type(state).__name__} cannot be shared")


def encode_state(tick: int, state: Any) -> bytes:
    """``tick | state`` (16 bytes) for a state that fits 64 bits, else ``tick | tag |
    payload`` with the tick's top bit set."""
    try:
        return TICK_STATE.pack(tick, state)
    except struct.error:  # a larger int, or bytes
        return TICK.pack(tick | TAGGED) + encode_payload(state)


def decode_state(raw: bytes) -> tuple[int, Any]:
    if len(raw) == 16:
        tick, state = TICK_STATE.unpack(raw)
        if tick < TAGGED:
            return tick, state
    tick = TICK.unpack_from(raw)[0] & ~TAGGED
    if raw[8:9] == b"i":
        return tick, int.from_bytes(raw[9:], "little", signed=True)
    return tick, bytes(raw[9:])


def key_bytes(key: str) -> bytes:
    raw = key.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_KEY_BYTES:
        return b"#" + hashlib.blake2b(raw, digest_size=32).digest()
    return raw
