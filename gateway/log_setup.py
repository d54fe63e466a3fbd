"""The gateway's log lines: text, or one JSON object per line (``--log-format json``).

A JSON access log line is a JSON object already; it is written as it is, never behind the text
prefix of the gateway's own lines, so ``jq`` reads the access log whatever ``--log-format`` is.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final, Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
# A record carrying this attribute (``extra={JSON_LINE: True}``) is a whole JSON object.
JSON_LINE: Final = "json_line"


def json_line(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the time first, for a log line that is a JSON object of its own."""
    return {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), **fields}


class GatewayFormatter(logging.Formatter):
    """Text or JSON for the gateway's own lines; JSON lines (the access log's) as they are."""

    def __init__(self, log_format: LogFormat) -> None:
        super().__init__()
        self._inner: logging.Formatter
        if log_format == "json":
            self._inner = JsonFormatter(
                "{levelname}{name}{process}{message}",
                style="{",
                timestamp="time",
                rename_fields={"levelname": "level", "name": "logger"},
                reserved_attrs=[*RESERVED_ATTRS, JSON_LINE],
            )
        else:
            self._inner = logging.Formatter(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, JSON_LINE, False):
            return record.getMessage()
        text = self._inner.format(record)
        if "\n" in text:
            # One record, one line in text too (a JSON line escapes its newlines itself): a
            # several-line reason or a traceback stays with its timestamp and level.
            text = " | ".join(line for line in text.splitlines() if line.strip())
        return text


def configure(level: str, log_format: LogFormat) -> None:
    """One stderr handler on the root logger (worker processes inherit it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(GatewayFormatter(log_format))
    logging.basicConfig(level=level, handlers=[handler], force=True)
