"""``gateway replay``: what a policy would have done to logged traffic.

The logs are read as requests (``log_formats``: one table of readers, one per format), decided
by the live gateway's own engine on a simulated clock (``simulate``, ``run``), and reported as
text, JSON or HTML (``report``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from gateway.engine.preflight import load_and_build
from gateway.policy.loader import PolicyError
from gateway.replay.gate import Condition, failures
from gateway.replay.log_formats import FORMATS, LogError
from gateway.replay.report import document, html_page, text
from gateway.replay.run import Run, replay
from gateway.replay.simulate import Simulation

__all__ = ["FORMATS", "Run", "Simulation", "document", "main", "replay"]


def main(
    logs: list[str],
    config: str,
    *,
    compare: str | None = None,
    fmt: str = "auto",
    forwarded_for: bool = False,
    as_json: bool = False,
    html_file: str | None = None,
    top: int = 10,
    window_s: float = 30.0,
    progress: bool | None = None,
    fail_if: list[Condition] | None = None,
) -> int:
    """Run a replay for the command line: 0, or 1 with one line on stderr for a user's error
    or for each ``fail_if`` condition that holds for the candidate (a CI gate)."""
    try:
        candidate = load_and_build(config)
        current = load_and_build(compare) if compare else None
    except PolicyError as exc:
        print(f"gateway replay: invalid policy:\n{exc}", file=sys.stderr)
        return 1
    for condition in fail_if or ():
        if condition.limit is not None and condition.limit not in candidate.policy.limits:
            names = ", ".join(candidate.policy.limits) or "none"
            print(
                f"gateway replay: --fail-if {condition.text!r}: {config} has no limit "
                f"{condition.limit!r} (its limits: {names})",
                file=sys.stderr,
            )
            return 1
    if logs.count("-") > 1:
        print("gateway replay: standard input ('-') can be read once", file=sys.stderr)
        return 1
    simulations = [Simulation(candidate, forwarded_for=forwarded_for)]
    if current is not None:
        simulations.append(Simulation(current, forwarded_for=forwarded_for))
    try:
        run = asyncio.run(
            replay(
                logs,
                simulations,
                fmt=fmt,
                window_us=round(window_s * 1_000_000),
                show_progress=progress,
            )
        )
    except LogError as exc:
        print(f"gateway replay: {exc}", file=sys.stderr)
        return 1
    doc = document(run, top=top)
    if html_file is not None:
        try:
            Path(html_file).write_text(html_page(doc), encoding="utf-8")
        except OSError as exc:
            print(f"gateway replay: {html_file}: cannot write: {exc.strerror}", file=sys.stderr)
            return 1
        # On stderr: stdout carries the report (or --json's document).
        print(f"gateway replay: wrote {Path(html_file).resolve()}", file=sys.stderr)
    if as_json:
        json.dump(doc, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text(doc))
    failed = failures(list(fail_if or ()), doc["policies"][0])
    for line in failed:
        print(f"gateway replay: failed: --fail-if {line}", file=sys.stderr)
    return 1 if failed else 0
