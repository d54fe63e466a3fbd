"""What the keys' API (``/keys``) asks of a store beyond deciding: the keys it holds for a
limit's tables, and a key forgotten (reset). A store without it answers the API 501."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KeyAdmin(Protocol):
    def keys_held(self, table: str, most: int) -> list[str]:
        """Up to ``most`` keys whose state the store holds in ``table``."""
        ...

    def holds(self, table: str, key: str) -> bool:
        """Whether the store holds ``key``'s state in ``table``."""
        ...

    def forget(self, table: str, key: str) -> bool:
        """Drop ``key``'s state in ``table`` (its next request starts afresh); whether it
        was held."""
        ...
