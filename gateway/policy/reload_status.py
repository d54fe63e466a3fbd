"""How a worker's reloads went: one record, read by ``/policy``, the metrics and the dashboard."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from gateway.clock import rfc3339


class ReloadStatus(BaseModel):
    """How this worker's reloads went: the one record ``/policy``, the metrics and the dashboard
    show. Frozen: the reloader replaces it, so a snapshot holding one never sees it change."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    succeeded: int = 0
    failed: int = 0
    unchanged: int = 0
    last_result: str = "none"
    last_error: str | None = None
    last_success_at: float | None = None
    last_attempt_at: float | None = None

    def shown(self) -> dict[str, Any]:
        """The record as ``/policy``, ``/status`` and the dashboard show it: each time (epoch
        seconds) with its RFC 3339 form beside it."""
        fields = self.model_dump()
        for name in ("last_success_at", "last_attempt_at"):
            fields[name + "_rfc3339"] = rfc3339(fields[name])
        return fields
