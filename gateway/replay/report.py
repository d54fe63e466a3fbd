"""What a replay found: one JSON document, rendered as text or as a self-contained HTML page."""

from __future__ import annotations

import html
import json
from array import array
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from gateway.limits.keys import key_in_words
from gateway.replay.log_formats import US
from gateway.replay.run import Run
from gateway.replay.simulate import (
    ALLOWED,
    DELAYED,
    DENIED,
    REJECTED,
    UNLIMITED,
    UNROUTED,
    Simulation,
)

# Points per chart at most: longer replays are summed into wider steps.
MAX_POINTS = 600
MALFORMED_SHOWN = 20


def show_key(key: str) -> str:
    """A limit key for people, as the limit log and the dashboard show it."""
    return key_in_words(key) if key else "(all clients)"


def _percentiles(values: array[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    last = len(ordered) - 1

    def rank(q: float) -> float:
        return round(ordered[min(last, int(q * len(ordered)))], 3)

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": round(ordered[-1], 3)}


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


def _step_s(first_s: int, last_s: int) -> int:
    span = last_s - first_s + 1
    step = 1
    for candidate in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600):
        step = candidate
        if span / candidate <= MAX_POINTS:
            break
    return step


def _binned(
    series: Mapping[int, Sequence[int]], width: int, first_s: int, step: int, points: int
) -> list[list[int]]:
    columns = [[0] * points for _ in range(width)]
    for second, values in series.items():
        index = (second - first_s) // step
        if 0 <= index < points:
            for column, value in zip(columns, values, strict=False):
                column[index] += value
    return columns


def _policy_document(
    simulation: Simulation, label: str, top: int, first_s: int, step: int, points: int
) -> dict[str, Any]:
    tally = simulation.tally
    counters = simulation.counters()
    outcomes = tally.outcomes
    requests = sum(outcomes.values())
    limits = []
    for name, limit in tally.limits.items():
        figures = counters[name]
        decided = figures["allowed"] + figures["delayed"] + figures["rejected"]
        if limit.dry_run:
            decided = figures["allowed"] + figures["dry_run_delayed"] + figures["dry_run_rejected"]
        columns = _binned(limit.series, 5, first_s, step, points)
        limits.append(
            {
                "name": name,
                "algorithm": limit.algorithm,
                "dry_run": limit.dry_run,
                **figures,
                "decided": decided,
                "rejected_ratio": _ratio(
                    figures["dry_run_rejected" if limit.dry_run else "rejected"], decided
                ),
                "delayed_ratio": _ratio(
                    figures["dry_run_delayed" if limit.dry_run else "delayed"], decided
                ),
                "delay_ms": _percentiles(limit.delays_ms),
                "peak_queue": limit.peak_queue,
                "max_queue": next(
                    lim.spec.max_queue for lim in simulation.engine.limits if lim.name == name
                ),
                "top_rejected_keys": [
                    {"key": show_key(key), "requests": count}
                    for key, count in limit.rejected_keys.most_common(top)
                ],
                "series": {
                    "allowed": columns[0],
                    "delayed": columns[1],
                    "rejected": columns[2],
                    "dry_run_delayed": columns[3],
                    "dry_run_rejected": columns[4],
                },
            }
        )
    overall = _binned(tally.series, 3, first_s, step, points)
    return {
        "label": label,
        "policy": simulation.loaded.source,
        "sha256": simulation.loaded.sha256,
        "requests": requests,
        "outcomes": {
            what: outcomes.get(what, 0)
            for what in (ALLOWED, DELAYED, REJECTED, DENIED, UNLIMITED, UNROUTED)
        },
        "rejected_ratio": _ratio(outcomes.get(REJECTED, 0), requests),
        "delayed_ratio": _ratio(outcomes.get(DELAYED, 0), requests),
        "rejected_by": dict(tally.rejected_by.most_common()),
        "delayed_by": dict(tally.delayed_by.most_common()),
        "delay_ms": _percentiles(tally.delays_ms),
        "limits": limits,
        "series": {"requests": overall[0], "delayed": overall[1], "rejected": overall[2]},
    }


def document(run: Run, top: int = 10) -> dict[str, Any]:
    """Everything a replay found, as one JSON-ready document (``--json`` prints it)."""
    stats = run.stats
    sims = run.simulations
    first_us = min((s.tally.first_us for s in sims if s.tally.first_us is not None), default=0)
    last_us = max((s.tally.last_us for s in sims if s.tally.last_us is not None), default=0)
    first_s, last_s = first_us // US, last_us // US
    # The gateway's own log is replayed on its limiter's clock (``t_us``, monotonic: seconds
    # since the host booted); its times for people are calendar times, that far apart.
    calendar_us = stats.unix_offset_us or 0
    step = _step_s(first_s, last_s)
    points = (last_s - first_s) // step + 1 if stats.requests else 0
    notes = list(stats.notes)
    if stats.spread_seconds:
        notes.append(
            "timestamps have whole seconds: the requests logged in one second are spread "
            "evenly across it"
        )
    if stats.own_records:
        notes.append(
            f"{stats.own_records:,} of the gateway's own log lines (not access lines) skipped"
        )
    if stats.late:
        notes.append(
            f"{stats.late} requests were logged later than the reorder window allows and were "
            "decided at the latest instant already replayed (--reorder-window)"
        )
    for sim in sims:
        if sim.live_store:
            notes.append(
                f"{sim.loaded.source}: limits kept in a shared store (Redis) in production are "
                "replayed in process, as one gateway would decide them"
            )
        if sim.matches_host and not stats.has_host:
            notes.append(
                f"{sim.loaded.source}: routes or limits match on the host, which the log does "
                "not carry: requests were matched with no host"
            )
        if sim.has_slots and sim.tally.slots_without_duration:
            notes.append(
                f"{sim.loaded.source}: {sim.tally.slots_without_duration:,} requests admitted "
                "by a concurrency limit had no duration in the log (nginx's $request_time, the "
                "gateway's duration_ms): their slots were given back at once, so the requests "
                "in flight are undercounted"
            )
        if sim.tally.slot_waits:
            notes.append(
                f"{sim.loaded.source}: {sim.tally.slot_waits:,} requests would have waited for "
                "a concurrency limit's slot (max_delay): the replay does not follow that line "
                "and counts them rejected"
            )
        if sim.counted_by_response:
            notes.append(
                f"{sim.loaded.source}: limits {', '.join(sim.counted_by_response)} are charged "
                "after the response: by the logged status"
                + ("" if stats.has_status else " (the log has none: each counted as a 200)")
                + ", at the request's instant; a request the logged gateway refused carries "
                "its status, not the upstream's"
            )
        if sim.cost_header_limits:
            notes.append(
                f"{sim.loaded.source}: limits {', '.join(sim.cost_header_limits)} charge what "
                "the upstream reported"
                + (
                    " (the log's costs; a request without one its configured cost)"
                    if stats.has_costs
                    else ", which the log does not carry: each request was charged its "
                    "configured cost"
                )
            )
        if sim.header_parts and not stats.has_headers:
            notes.append(
                f"{sim.loaded.source}: key parts {', '.join(sim.header_parts)} read request "
                "headers or query parameters the log may not carry: such limits were skipped "
                "or keyed as on_missing_key says (the gateway's own log carries the headers "
                "its server.access_log.fields names)"
            )
    labels = ["candidate", "current"] if len(sims) == 2 else ["policy"]
    doc: dict[str, Any] = {
        "logs": [{"file": name, "format": fmt} for name, fmt in stats.formats.items()],
        "lines": stats.lines,
        "requests": stats.requests,
        "malformed": {
            "count": stats.malformed,
            "lines": [
                {"file": m.source, "line": m.line, "reason": m.reason} for m in stats.malformed_kept
            ],
        },
        "late": stats.late,
        "first_ts": (first_us + calendar_us) / US if stats.requests else None,
        "span_s": round((last_us - first_us) / US, 6) if stats.requests else 0.0,
        "elapsed_s": round(run.elapsed_s, 3),
        "lines_per_s": round(stats.lines / run.elapsed_s) if run.elapsed_s > 0 else None,
        "notes": notes,
        # Epoch seconds of the first point (the charts' time axis), to the second.
        "series_start_s": (first_s * US + calendar_us) // US,
        "series_step_s": step,
        "policies": [
            _policy_document(sim, label, top, first_s, step, points)
            for sim, label in zip(sims, labels, strict=True)
        ],
    }
    if run.changes is not None:
        changes = run.changes
        doc["compare"] = {
            "requests_newly_rejected": changes.requests_newly_rejected,
            "requests_newly_admitted": changes.requests_newly_admitted,
            "clients_newly_rejected": len(changes.newly_rejected),
            "clients_newly_admitted": len(changes.newly_admitted),
            "newly_rejected": [
                {"client": c, "requests": n} for c, n in changes.newly_rejected.most_common(top)
            ],
            "newly_admitted": [
                {"client": c, "requests": n} for c, n in changes.newly_admitted.most_common(top)
            ],
        }
    return doc


# -- text --------------------------------------------------------------------------------------


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.2f}%"


def _delays(delay: dict[str, float] | None) -> str:
    if delay is None:
        return "-"
    return (
        f"p50 {delay['p50']:g} / p90 {delay['p90']:g} / p99 {delay['p99']:g} / "
        f"max {delay['max']:g} ms"
    )


def text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    logs = ", ".join(f"{log['file']} ({log['format']})" for log in doc["logs"])
    out.append(f"logs: {logs}")
    out.append(
        f"{doc['lines']:,} lines, {doc['requests']:,} requests over {doc['span_s']:,.1f} s of "
        f"traffic; replayed in {doc['elapsed_s']:.2f} s ({doc['lines_per_s'] or 0:,} lines/s)"
    )
    malformed = doc["malformed"]
    if malformed["count"]:
        out.append(f"malformed lines: {malformed['count']:,}")
        for item in malformed["lines"][:MALFORMED_SHOWN]:
            out.append(f"  {item['file']}:{item['line']}: {item['reason']}")
        if malformed["count"] > MALFORMED_SHOWN:
            out.append(f"  ... and {malformed['count'] - MALFORMED_SHOWN:,} more")
    for note in doc["notes"]:
        out.append(f"note: {note}")
    for policy in doc["policies"]:
        out.append("")
        out.append(f"== {policy['label']}: {policy['policy']} (sha256 {policy['sha256'][:12]})")
        outcomes = policy["outcomes"]
        requests = policy["requests"]
        out.append(
            f"requests {requests:,}: rejected {outcomes['rejected']:,} "
            f"({_pct(policy['rejected_ratio'])}), delayed {outcomes['delayed']:,} "
            f"({_pct(policy['delayed_ratio'])}), admitted at once {outcomes['allowed']:,}, "
            f"no limit {outcomes['unlimited']:,}, denied {outcomes['denied']:,}, "
            f"no route {outcomes['unrouted']:,}"
        )
        if policy["rejected_by"]:
            out.append(
                "rejected by: "
                + ", ".join(f"{name} {count:,}" for name, count in policy["rejected_by"].items())
            )
        if policy["delayed_by"]:
            out.append(
                "delayed by: "
                + ", ".join(f"{name} {count:,}" for name, count in policy["delayed_by"].items())
            )
        if policy["delay_ms"]:
            out.append(f"delay: {_delays(policy['delay_ms'])}")
        for limit in policy["limits"]:
            dry = " (dry run: would)" if limit["dry_run"] else ""
            rejected = limit["dry_run_rejected"] if limit["dry_run"] else limit["rejected"]
            delayed = limit["dry_run_delayed"] if limit["dry_run"] else limit["delayed"]
            out.append(
                f"  {limit['name']} [{limit['algorithm']}]{dry}: decided {limit['decided']:,}, "
                f"admitted {limit['allowed']:,}, delayed {delayed:,} "
                f"({_pct(limit['delayed_ratio'])}), rejected {rejected:,} "
                f"({_pct(limit['rejected_ratio'])})"
            )
            if limit["delay_ms"]:
                out.append(
                    f"    delay {_delays(limit['delay_ms'])}; peak queue "
                    f"{limit['peak_queue']:,} of {limit['max_queue']:,}"
                )
            if limit["top_rejected_keys"]:
                keys = ", ".join(
                    f"{item['key']} ({item['requests']:,})" for item in limit["top_rejected_keys"]
                )
                out.append(f"    top rejected keys: {keys}")
    compare = doc.get("compare")
    if compare is not None:
        out.append("")
        out.append(
            f"== candidate against current: {compare['requests_newly_rejected']:,} requests of "
            f"{compare['clients_newly_rejected']:,} clients newly rejected, "
            f"{compare['requests_newly_admitted']:,} of {compare['clients_newly_admitted']:,} "
            "newly admitted"
        )
        for title, key in (
            ("newly rejected", "newly_rejected"),
            ("newly admitted", "newly_admitted"),
        ):
            if compare[key]:
                out.append(
                    f"  {title}: "
                    + ", ".join(f"{item['client']} ({item['requests']:,})" for item in compare[key])
                )
    return "\n".join(out) + "\n"


# -- HTML --------------------------------------------------------------------------------------


def _vendor(name: str) -> str:
    return (
        resources.files("gateway")
        .joinpath("static", "dashboard", "vendor", name)
        .read_text(encoding="utf-8")
    )


def _script_safe(value: Any) -> str:
    """JSON inside a <script> element: no '</' can close it early."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")


_PAGE_SCRIPT = r"""
(function () {
  const doc = JSON.parse(document.getElementById("replay-data").textContent);
  const colours = {allowed: "#2e7d32", delayed: "#f9a825", rejected: "#c62828",
                   dry_run_delayed: "#ffcc80", dry_run_rejected: "#ef9a9a", requests: "#1565c0"};
  const times = [];
  const points = doc.policies.length ? doc.policies[0].series.requests.length : 0;
  for (let i = 0; i < points; i++) times.push(doc.series_start_s + i * doc.series_step_s);
  // Times as the log has them, in UTC, whatever the viewer's zone.
  const utc = (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC");
  function seriesOf(policy, chartName) {
    if (chartName === "overall") return policy.series;
    const limit = policy.limits.find((l) => l.name === chartName);
    return limit ? limit.series : null;
  }
  // One y-scale per chart across the policies compared: the same height means the same count.
  function peak(chartName) {
    let top = 1;
    for (const policy of doc.policies) {
      const series = seriesOf(policy, chartName);
      if (series) for (const values of Object.values(series)) top = Math.max(top, ...values);
    }
    return top * 1.05;
  }
  function chart(element, title, series, yMax) {
    const names = Object.keys(series).filter(
      (name) => !name.startsWith("dry_run") || series[name].some((v) => v > 0));
    const opts = {
      title: title, width: Math.min(900, element.clientWidth || 900), height: 220,
      tzDate: utc,
      scales: {x: {time: true}, y: {range: [0, yMax]}},
      axes: [{label: "UTC"}, {label: "requests per " + doc.series_step_s + " s", size: 60}],
      series: [{}].concat(names.map((name) => ({
        label: name.replace(/_/g, " "), stroke: colours[name], width: 1.5,
        fill: colours[name] + "22"}))),
    };
    new uPlot(opts, [times].concat(names.map((name) => series[name])), element);
    element.dataset.rendered = "true";
    element.dataset.yMax = String(yMax);
  }
  document.querySelectorAll("[data-chart]").forEach((element) => {
    const policy = doc.policies[Number(element.dataset.policy)];
    const name = element.dataset.chart;
    if (name === "overall") {
      chart(element, "all requests", policy.series, peak(name));
    } else {
      const limit = policy.limits.find((l) => l.name === name);
      chart(element, limit.name + " (" + limit.algorithm + ")", limit.series, peak(name));
    }
  });
})();
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.policies { display: flex; flex-wrap: wrap; gap: 2em; }
.policy { flex: 1 1 600px; min-width: 0; overflow-x: auto; }
section table { font-size: 12px; }
.chart { margin: 0.5em 0 1.5em; }
.note { color: #6d4c41; }
code { background: #f4f4f4; padding: 0 3px; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt_delay(delay: dict[str, float] | None) -> str:
    return "-" if delay is None else f"{delay['p50']:g} / {delay['p90']:g} / {delay['p99']:g}"


def html_page(doc: dict[str, Any]) -> str:
    """A page with everything inlined (uPlot, its CSS, the data): it opens offline."""
    parts: list[str] = []
    esc = html.escape
    parts.append(
        f"<p>{doc['lines']:,} lines, {doc['requests']:,} requests over "
        f"{doc['span_s']:,.1f} s of traffic from "
        + esc(", ".join(f"{log['file']} ({log['format']})" for log in doc["logs"]))
        + f"; {doc['malformed']['count']:,} malformed lines.</p>"
    )
    for note in doc["notes"]:
        parts.append(f'<p class="note">{esc(note)}</p>')
    if doc["malformed"]["lines"]:
        parts.append(
            "<details><summary>malformed lines</summary>"
            + _table(
                ("file", "line", "reason"),
                [(m["file"], m["line"], m["reason"]) for m in doc["malformed"]["lines"]],
            )
            + "</details>"
        )
    parts.append('<div class="policies">')
    for index, policy in enumerate(doc["policies"]):
        outcomes = policy["outcomes"]
        parts.append(
            f'<section class="policy" id="policy-{index}"><h2>{esc(policy["label"])}: '
            f"<code>{esc(policy['policy'])}</code></h2>"
        )
        parts.append(
            _table(
                (
                    "requests",
                    "rejected",
                    "delayed",
                    "admitted at once",
                    "no limit",
                    "denied",
                    "no route",
                    "delay p50/p90/p99 ms",
                ),
                [
                    (
                        f"{policy['requests']:,}",
                        f"{outcomes['rejected']:,} ({policy['rejected_ratio'] * 100:.2f}%)",
                        f"{outcomes['delayed']:,} ({policy['delayed_ratio'] * 100:.2f}%)",
                        f"{outcomes['allowed']:,}",
                        f"{outcomes['unlimited']:,}",
                        f"{outcomes['denied']:,}",
                        f"{outcomes['unrouted']:,}",
                        _fmt_delay(policy["delay_ms"]),
                    )
                ],
            )
        )
        parts.append(
            _table(
                (
                    "limit",
                    "algorithm",
                    "admitted",
                    "delayed",
                    "rejected",
                    "rejected %",
                    "delay p50/p90/p99 ms",
                    "peak queue",
                ),
                [
                    (
                        limit["name"] + (" (dry run)" if limit["dry_run"] else ""),
                        limit["algorithm"],
                        f"{limit['allowed']:,}",
                        f"{limit['dry_run_delayed' if limit['dry_run'] else 'delayed']:,}",
                        f"{limit['dry_run_rejected' if limit['dry_run'] else 'rejected']:,}",
                        f"{limit['rejected_ratio'] * 100:.2f}",
                        _fmt_delay(limit["delay_ms"]),
                        f"{limit['peak_queue']:,} / {limit['max_queue']:,}",
                    )
                    for limit in policy["limits"]
                ],
            )
        )
        keys = [
            (limit["name"], key["key"], f"{key['requests']:,}")
            for limit in policy["limits"]
            for key in limit["top_rejected_keys"]
        ]
        if keys:
            parts.append(
                "<details><summary>top rejected keys</summary>"
                + _table(("limit", "key", "rejected requests"), keys)
                + "</details>"
            )
        parts.append(f'<div class="chart" data-chart="overall" data-policy="{index}"></div>')
        skipped = [limit["name"] for limit in policy["limits"] if not limit["decided"]]
        for limit in policy["limits"]:
            if limit["decided"]:
                parts.append(
                    f'<div class="chart" data-chart="{esc(limit["name"])}" '
                    f'data-policy="{index}"></div>'
                )
        if skipped:
            # An empty chart would say "no traffic" where the limit never applied.
            parts.append(
                f'<p class="note">Decided no request (no chart): {esc(", ".join(skipped))}.</p>'
            )
        parts.append("</section>")
    parts.append("</div>")
    compare = doc.get("compare")
    if compare is not None:
        parts.append("<h2>Clients whose outcome changes</h2>")
        parts.append(
            f"<p>{compare['requests_newly_rejected']:,} requests of "
            f"{compare['clients_newly_rejected']:,} clients newly rejected, "
            f"{compare['requests_newly_admitted']:,} of {compare['clients_newly_admitted']:,} "
            "newly admitted.</p>"
        )
        parts.append(
            _table(
                ("newly rejected client", "requests"),
                [(i["client"], f"{i['requests']:,}") for i in compare["newly_rejected"]],
            )
        )
        parts.append(
            _table(
                ("newly admitted client", "requests"),
                [(i["client"], f"{i['requests']:,}") for i in compare["newly_admitted"]],
            )
        )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>gateway replay</title>"
        f"<style>{_vendor('uPlot.min.css')}</style><style>{_STYLE}</style></head><body>"
        "<h1>gateway replay</h1>"
        + "".join(parts)
        + f'<script type="application/json" id="replay-data">{_script_safe(doc)}</script>'
        + f"<script>{_vendor('uPlot.iife.min.js')}</script>"
        + f"<script>{_PAGE_SCRIPT}</script></body></html>\n"
    )
