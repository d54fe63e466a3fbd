"""What the WebSocket relay counts as bytes pass: the edge adds, observability reads."""

from __future__ import annotations


class UpgradeStats:
    """Upgraded (WebSocket) connections: open now, opened in all, bytes relayed each way, and
    how many the idle timeout closed. The relay adds to these as bytes pass (one int add)."""

    __slots__ = ("bytes_from_client", "bytes_from_upstream", "idle_timeouts", "open", "total")

    def __init__(self) -> None:
        self.open = 0
        self.total = 0
        self.bytes_from_client = 0
        self.bytes_from_upstream = 0
        self.idle_timeouts = 0
