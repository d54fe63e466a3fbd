"""Where a limit's states live in Redis: the cluster hash tag, the key layout, the fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.algorithms.base import Algorithm
from gateway.limits.compiled import CompiledLimit
from gateway.stores.redis.codecs import Codec

WHOLE_KEY: Final = -1
FIXED_TAG: Final = -2


def tag_scheme(limits: Sequence[CompiledLimit]) -> str | None:
    """The key part every limit's key has, whose value becomes the cluster hash tag; ``None``
    when there is none (then all keys share one fixed tag, hence one slot)."""
    if not limits:
        return None
    if len(limits) > 1 and any(limit.spec.unlisted == "shared" for limit in limits):
        return None  # the unlisted keys of one share one key, whatever their tag part holds
    common = set(limits[0].spec.key)
    for limit in limits[1:]:
        common &= set(limit.spec.key)
    for part in limits[0].spec.key:
        if part in common:
            return part
    return None


@dataclass(frozen=True, slots=True)
class LimitPlan:
    """A limit ready for Redis: its codec, key layout and this replica's local share."""

    algorithm: Algorithm[Any]
    codec: Codec
    key_head: str  # "{prefix}" ... everything before the tag
    key_tail: str  # "}{limit}:{fingerprint}:"
    tag_index: int  # index of the tag part in the key, WHOLE_KEY or FIXED_TAG
    local: CompiledLimit
    # The limit's ``penalty:`` for the script, b"after within_us block_us" (b"": none), and
    # where its penalty boxes live: beside the states, same tag (one slot), another name.
    penalty: bytes = b""
    penalty_tail: str = ""

    def redis_key(self, key: str) -> str:
        return f"{self.key_head}{self._tag(key)}{self.key_tail}{key}"

    def penalty_key(self, key: str) -> str:
        """Where ``key``'s penalty box lives (not under ``key_tail``: a SCAN of the limit's
        states, the keys' API, does not meet it)."""
        return f"{self.key_head}{self._tag(key)}{self.penalty_tail}{key}"

    def _tag(self, key: str) -> str:
        index = self.tag_index
        if index == WHOLE_KEY:
            tag = key
        elif index == FIXED_TAG:
            tag = "*"
        else:
            parts = key.split("\x1f")
            tag = parts[index] if index < len(parts) else key
        if not tag or "}" in tag:
            tag = tag.replace("}", "%7D") or "~"  # an empty tag would hash the whole key
        return tag


def fingerprint(limit: CompiledLimit, codec: Codec) -> str:
    """The algorithm (the parameters' letter) and the key's parts, not the parameters: those
    are stored with each state, and a reload that changes them rescales the state."""
    digest = hashlib.blake2s(digest_size=4)
    digest.update(codec.params[:1])
    digest.update("\x1f".join((*limit.spec.key, limit.spec.on_missing_key)).encode())
    return digest.hexdigest()
