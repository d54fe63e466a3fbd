"""How a worker's reloads went: one record, read by ``/policy``, the metrics and the dashboard."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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
