"""``gateway suggest --html``: the distributions with the chosen thresholds drawn, and the
proof (who the replayed proposal refuses, and when). Inline SVG drawn here: it opens offline."""

from __future__ import annotations

import html
import math
from datetime import UTC, datetime
from typing import Final

from gateway.suggest.proof import Proof
from gateway.suggest.proposal import Proposal, Threshold

_W: Final = 900
_H: Final = 220
_LEFT: Final = 70
_TOP: Final = 24
_BOTTOM: Final = 28
_POINTS: Final = 600
_STYLE: Final = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
svg { display: block; margin: 0.5em 0 1em; }
pre { background: #f6f6f6; padding: 0.5em; }
"""


def _when(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _table(headers: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _log_y(value: float, top: float) -> float:
    """Height fraction on a log scale from 1 to ``top``."""
    return math.log10(1 + value) / math.log10(1 + top) if top > 0 else 0.0


def rank_svg(name: str, label: str, line: Threshold, setting: str) -> str:
    """Every key's value, ascending (at most ``_POINTS`` drawn; those above the line all),
    on a log scale, with the line drawn."""
    values = line.values
    count = len(values)
    plot_w, plot_h = _W - _LEFT - 20, _H - _TOP - _BOTTOM
    top = max(values[-1] if values else 1, line.value, 1)
    picks = sorted(
        {round(i * (count - 1) / max(_POINTS - 1, 1)) for i in range(min(count, _POINTS))}
        | {i for i in range(count) if values[i] > line.value}
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'data-chart="rank" data-limit="{html.escape(name)}" data-setting="{setting}" '
        f'data-threshold="{line.value}" '
        f'data-refused="{line.refused}">',
        f'<text x="{_LEFT}" y="16" font-size="13">{html.escape(name)}: {html.escape(label)}, '
        f"one point per key, ascending (log scale); the line: {line.value:,}</text>",
    ]
    for i in picks:
        x = _LEFT + (i / max(count - 1, 1)) * plot_w
        y = _TOP + plot_h * (1 - _log_y(values[i], top))
        colour = "#c62828" if values[i] > line.value else "#2e7d32"
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}"/>')
    y = _TOP + plot_h * (1 - _log_y(line.value, top))
    parts.append(
        f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_W - 20}" y2="{y:.1f}" stroke="#1565c0" '
        'stroke-dasharray="5 3" data-line="threshold"/>'
    )
    parts.append(
        f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">'
        f"{line.value:,}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def rate_svg(per_second: list[int], rate_per_s: float) -> str:
    """All requests per second over the log (the busiest second of each step), and the global
    rate drawn across."""
    steps = max(1, math.ceil(len(per_second) / _POINTS))
    peaks = [max(per_second[i : i + steps]) for i in range(0, len(per_second), steps)]
    plot_w, plot_h = _W - _LEFT - 20, _H - _TOP - _BOTTOM
    top = max([*peaks, rate_per_s, 1])
    points = " ".join(
        f"{_LEFT + i * plot_w / max(len(peaks) - 1, 1):.1f},{_TOP + plot_h * (1 - v / top):.1f}"
        for i, v in enumerate(peaks)
    )
    y = _TOP + plot_h * (1 - rate_per_s / top)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" data-chart="rate">'
        f'<text x="{_LEFT}" y="16" font-size="13">all requests per second (the busiest of each '
        f"{steps} s); the line: the global rate, {rate_per_s:g} r/s</text>"
        f'<polyline fill="none" stroke="#2e7d32" points="{points}"/>'
        f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_W - 20}" y2="{y:.1f}" stroke="#1565c0" '
        'stroke-dasharray="5 3"/></svg>'
    )


def html_page(proposal: Proposal, proof: Proof, policy_file: str, policy_text: str) -> str:
    esc = html.escape
    parts = [
        f"<h1>gateway suggest: <code>{esc(policy_file)}</code></h1>",
        f"<p>{proposal.requests:,} requests from {proposal.clients:,} clients over "
        f"{proposal.span_ms / 1000:,.0f} s; at most {proposal.share * 100:g}% of the keys of "
        "each per-key limit refused at their peaks.</p>",
        "<h2>Proof: the proposal replayed on the same logs</h2>",
        f"<p>{proof.rejected:,} of {proof.requests:,} requests refused "
        f"({100.0 * proof.rejected / max(proof.requests, 1):.2f}%).</p>",
    ]
    rows: list[list[object]] = []
    for limit, keys in proof.refused.items():
        for key, record in sorted(keys.items(), key=lambda kv: (-kv[1].requests, kv[0]))[:50]:
            rows.append(
                [
                    limit,
                    key,
                    f"{record.requests:,}",
                    _when(record.first_us + proof.unix_offset_us),
                    _when(record.last_us + proof.unix_offset_us),
                ]
            )
    parts.append(_table(["limit", "key", "refused", "first (UTC)", "last (UTC)"], rows))
    parts.append("<h2>The limits and their evidence</h2>")
    for proposed in proposal.limits:
        parts.append(f"<h3>{esc(proposed.name)}</h3><ul>")
        parts += [f"<li>{esc(sentence)}</li>" for sentence in proposed.evidence]
        parts.append("</ul>")
        if proposed.rate_chart is not None:
            label = "requests in the busiest minute of each key"
            parts.append(rank_svg(proposed.name, label, proposed.rate_chart, "rate"))
        if proposed.chart is not None:
            parts.append(rank_svg(proposed.name, proposed.chart_label, proposed.chart, "burst"))
    parts.append("<h2>Requests per key in any window</h2>")
    for kind, windows in proposal.distributions.items():
        parts.append(
            _table(
                [kind, "p50", "p90", "p99", "max"],
                [
                    [w, *(f"{p[q]:,}" for q in ("p50", "p90", "p99", "max"))]
                    for w, p in windows.items()
                ],
            )
        )
    parts.append(rate_svg(proposal.per_second, proposal.global_rate_per_s))
    parts.append(f"<h2>The policy</h2><pre>{esc(policy_text)}</pre>")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>gateway suggest</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + "</body></html>\n"
    )
