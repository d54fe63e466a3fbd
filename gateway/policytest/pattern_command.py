"""``gateway simulate POLICY --pattern ...``: an arrival pattern against a policy, counted and
drawn (HTML always on request, PNG when matplotlib is there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gateway.engine.preflight import load_and_build
from gateway.policy.loader import PolicyError
from gateway.policytest.arrivals import Pattern, PatternError, arrivals
from gateway.policytest.pattern_chart import PngUnavailable, html_page, write_png
from gateway.policytest.pattern_run import run_pattern, timeline
from gateway.replay.log_formats import LogError, ReadStats
from gateway.replay.simulate import Simulation


def simulate(
    policy_file: str,
    patterns: list[Pattern],
    headers: tuple[tuple[str, str], ...] = (),
    compare: str | None = None,
) -> dict[str, Any]:
    """The patterns run against the policy (and the same requests against ``compare``, under
    ``doc["compare"]``): the document the text, HTML and PNG show. Raises ``PolicyError``,
    ``PatternError`` or ``LogError``."""
    docs = []
    for file in (policy_file, compare):
        if file is None:
            continue
        simulation = Simulation(load_and_build(file))
        # The patterns are deterministic: generated again, the same requests.
        doc = timeline(run_pattern(simulation, arrivals(patterns, headers, ReadStats())))
        doc["patterns"] = [p.text for p in patterns]
        docs.append(doc)
    if len(docs) == 2:
        docs[0]["compare"] = docs[1]
    return docs[0]


def text(doc: dict[str, Any]) -> str:
    compared = doc.get("compare")
    return _text(doc) + (f"compared with\n{_text(compared)}" if compared else "")


def _text(doc: dict[str, Any]) -> str:
    totals = doc["totals"]
    out = [
        f"{doc['policy']}: {doc['requests']:,} requests over {doc['span_ms'] / 1000:g} s "
        f"({'; '.join(doc['patterns'])})",
        "admitted at once {admitted:,}, delayed {delayed:,}, rejected {rejected:,}, "
        "refused otherwise {other:,}".format(**totals),
    ]
    for limit in doc["limits"]:
        c = limit["counters"]
        out.append(
            f"  {limit['name']} [{limit['algorithm']}]: admitted {c['allowed']:,}, "
            f"delayed {c['delayed']:,}, rejected {c['rejected']:,}"
        )
    return "\n".join(out) + "\n"


def main(
    policy_file: str,
    patterns: list[Pattern],
    *,
    headers: tuple[tuple[str, str], ...] = (),
    html_file: str | None = None,
    png_file: str | None = None,
    as_json: bool = False,
    compare: str | None = None,
) -> int:
    try:
        doc = simulate(policy_file, patterns, headers, compare)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    except (PatternError, LogError) as exc:
        print(f"gateway simulate: {exc}", file=sys.stderr)
        return 1
    try:
        if html_file is not None:
            Path(html_file).write_text(html_page(doc), encoding="utf-8")
            print(f"gateway simulate: wrote {Path(html_file).resolve()}", file=sys.stderr)
        if png_file is not None:
            write_png(doc, png_file)
            print(f"gateway simulate: wrote {Path(png_file).resolve()}", file=sys.stderr)
    except PngUnavailable as exc:
        print(f"gateway simulate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gateway simulate: {exc.filename}: cannot write: {exc.strerror}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(doc, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text(doc))
    return 0
