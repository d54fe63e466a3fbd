"""``gateway simulate``'s pictures: an HTML page with inline SVG drawn here (it opens offline,
needs no script), and a PNG when matplotlib is installed (the ``bench`` extra).

The top chart stacks what came of the requests in each step (admitted at once, delayed,
rejected, refused otherwise); below it, one chart per limit draws its level, the least quota
left among the keys it decided in the step, under its quota. Each bar carries its count
(``data-group``, ``data-count``): what the page draws is what the engine decided.
"""

from __future__ import annotations

import html
import json
from typing import Any, Final

COLOURS: Final = {
    "admitted": "#2e7d32",
    "delayed": "#f9a825",
    "rejected": "#c62828",
    "other": "#757575",
}
LEVEL_COLOUR: Final = "#1565c0"
_WIDTH: Final = 900
_LEFT: Final = 60
_RIGHT: Final = 20
_TOP: Final = 24
_BOTTOM: Final = 30


class PngUnavailable(Exception):
    """matplotlib is not installed: the one line the user sees."""


def _seconds(ms: float) -> str:
    return f"{ms / 1000:g}s"


def _ticks(doc: dict[str, Any], bins: int, plot_w: float) -> list[str]:
    """Five labels along the time axis, seconds from the first request."""
    parts = []
    for i in range(5):
        index = round(i * max(bins - 1, 0) / 4)
        x = _LEFT + (index + 0.5) * plot_w / max(bins, 1)
        label = _seconds(index * doc["step_ms"])
        parts.append(
            f'<text x="{x:.1f}" y="{{bottom}}" font-size="11" text-anchor="middle">{label}</text>'
        )
    return parts


def peak_step(doc: dict[str, Any]) -> int:
    """The most requests in one step: the top of the bars' scale."""
    series = doc["series"]
    return max([sum(values) for values in zip(*series.values(), strict=True)] or [0]) or 1


def counts_svg(doc: dict[str, Any], peak: int) -> str:
    """Stacked bars per step: admitted, delayed, rejected, other; ``peak`` at the top (one
    scale for policies compared)."""
    series = doc["series"]
    bins = len(series["admitted"])
    height = 260
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = height - _TOP - _BOTTOM
    bar_w = plot_w / max(bins, 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'data-chart="requests" data-step-ms="{doc["step_ms"]}" data-peak="{peak}">',
        f'<text x="{_LEFT}" y="16" font-size="13">requests per {_seconds(doc["step_ms"])}: '
        "admitted, delayed, rejected, refused otherwise (peak "
        f"{peak:,})</text>",
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_WIDTH - _RIGHT}" '
        f'y2="{_TOP + plot_h}" stroke="#999"/>',
    ]
    for index in range(bins):
        y = float(_TOP + plot_h)
        for group, colour in COLOURS.items():
            count = series[group][index]
            if not count:
                continue
            h = count * plot_h / peak
            y -= h
            parts.append(
                f'<rect x="{_LEFT + index * bar_w:.2f}" y="{y:.2f}" width="{max(bar_w, 0.5):.2f}" '
                f'height="{h:.2f}" fill="{colour}" data-group="{group}" data-bin="{index}" '
                f'data-count="{count}"/>'
            )
    parts += [t.replace("{bottom}", str(height - 10)) for t in _ticks(doc, bins, plot_w)]
    parts.append("</svg>")
    return "".join(parts)


def level_svg(doc: dict[str, Any], limit: dict[str, Any]) -> str:
    """A limit's level per step (the least quota left) under its quota."""
    level = limit["level"] or []
    bins = len(level)
    height = 150
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = height - _TOP - _BOTTOM
    quota = max(limit["quota"], max((v for v in level if v is not None), default=0), 1)
    step_w = plot_w / max(bins, 1)
    name = html.escape(limit["name"])
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'data-chart="level" data-limit="{name}">',
        f'<text x="{_LEFT}" y="16" font-size="13">{name} ({html.escape(limit["algorithm"])}): '
        f"quota left, of {limit['quota']:,}"
        + (
            f"; waiting in its queue (amber), at most {max(limit['queue']):,}"
            if limit.get("queue")
            else ""
        )
        + "</text>",
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_WIDTH - _RIGHT}" y2="{_TOP}" stroke="#999" '
        'stroke-dasharray="4 3"/>',
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_WIDTH - _RIGHT}" '
        f'y2="{_TOP + plot_h}" stroke="#999"/>',
    ]
    points = []
    for index, value in enumerate(level):
        if value is None:
            continue
        x = _LEFT + (index + 0.5) * step_w
        y = _TOP + plot_h - value * plot_h / quota
        points.append(f"{x:.2f},{y:.2f}")
    if points:
        parts.append(
            f'<polyline fill="none" stroke="{LEVEL_COLOUR}" stroke-width="1.5" '
            f'points="{" ".join(points)}" data-series="level"/>'
        )
    queue = limit.get("queue")
    if queue:
        # The queue on the same scale, in the delayed requests' colour.
        peak = max(queue)
        top = max(quota, peak)
        parts.append(
            f'<polyline fill="none" stroke="{COLOURS["delayed"]}" stroke-width="1.5" '
            f'data-series="queue" data-peak="{peak}" points="'
            + " ".join(
                f"{_LEFT + (i + 0.5) * step_w:.2f},{_TOP + plot_h - v * plot_h / top:.2f}"
                for i, v in enumerate(queue)
            )
            + '"/>'
        )
    parts += [t.replace("{bottom}", str(height - 10)) for t in _ticks(doc, bins, plot_w)]
    parts.append("</svg>")
    return "".join(parts)


_STYLE: Final = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
svg { display: block; margin: 0.5em 0 1em; }
.key span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }
"""


def _table(headers: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(doc: dict[str, Any], peak: int, title: str) -> list[str]:
    esc = html.escape
    totals = doc["totals"]
    parts = [
        f"<section><h2>{esc(title)}: <code>{esc(doc['policy'])}</code></h2>",
        _table(
            ["requests", *totals],
            [[f"{doc['requests']:,}", *(f"{totals[g]:,}" for g in totals)]],
        ),
        _table(
            ["limit", "algorithm", "admitted", "delayed", "rejected"],
            [
                [
                    lim["name"],
                    lim["algorithm"],
                    f"{lim['counters']['allowed']:,}",
                    f"{lim['counters']['delayed']:,}",
                    f"{lim['counters']['rejected']:,}",
                ]
                for lim in doc["limits"]
            ],
        ),
        counts_svg(doc, peak),
    ]
    parts += [level_svg(doc, lim) for lim in doc["limits"] if lim["level"] is not None]
    parts.append("</section>")
    return parts


def html_page(doc: dict[str, Any]) -> str:
    """The policy's section (and the one compared, its bars on the same scale), the data
    embedded."""
    esc = html.escape
    compared = doc.get("compare")
    docs = [doc, compared] if compared else [doc]
    peak = max(peak_step(d) for d in docs)
    parts = [
        f"<h1>gateway simulate: <code>{esc(doc['policy'])}</code>"
        + (f" and <code>{esc(compared['policy'])}</code>" if compared else "")
        + "</h1>",
        "<p>" + esc(", ".join(doc["patterns"])) + f": {doc['requests']:,} requests over "
        f"{doc['span_ms'] / 1000:g} s.</p>",
        '<p class="key">'
        + "".join(f'<span style="background:{c}"></span>{g}' for g, c in COLOURS.items())
        + "</p>",
    ]
    parts += _section(doc, peak, "policy")
    if compared:
        parts += _section(compared, peak, "compared with")
    data = json.dumps(doc, separators=(",", ":")).replace("</", "<\\/")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>gateway simulate</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + f'<script type="application/json" id="simulate-data">{data}</script>'
        + "</body></html>\n"
    )


def write_png(doc: dict[str, Any], path: str) -> None:
    """The same charts as a PNG, drawn by matplotlib (not a runtime dependency)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise PngUnavailable(
            "--png needs matplotlib, which is not installed: pip install matplotlib "
            "(or 'rl-gateway[bench]'), or use --html"
        ) from None
    compared = doc.get("compare")
    docs = [doc, compared] if compared else [doc]
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for shown in docs:
        rows.append((shown, None))
        rows += [(shown, lim) for lim in shown["limits"] if lim["level"] is not None]
    figure, axes = plt.subplots(
        len(rows),
        1,
        figsize=(10, 1.6 * len(rows) + 1.4 * len(docs)),
        sharex=True,
        gridspec_kw={"height_ratios": [2 if lim is None else 1 for _, lim in rows]},
        squeeze=False,
    )
    peak = max(peak_step(d) for d in docs)
    step_s = doc["step_ms"] / 1000
    xs = [i * step_s for i in range(len(doc["series"]["admitted"]))]
    for axis, (shown, limit) in zip((row[0] for row in axes), rows, strict=True):
        if limit is None:
            _png_counts(axis, shown, xs, step_s, peak)
        else:
            _png_level(axis, limit, xs)
    axes[-1][0].set_xlabel("seconds from the first request")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _png_counts(axis: Any, doc: dict[str, Any], xs: list[float], step_s: float, peak: int) -> None:
    series = doc["series"]
    bottom = [0] * len(xs)
    for group, colour in COLOURS.items():
        axis.bar(xs, series[group], width=step_s, bottom=bottom, color=colour, label=group,
                 align="edge")  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, series[group], strict=True)]
    axis.set_ylim(0, peak * 1.05)
    axis.set_ylabel(f"requests per {step_s:g} s")
    axis.set_title(doc["policy"])
    axis.legend(loc="upper right")


def _png_level(axis: Any, limit: dict[str, Any], xs: list[float]) -> None:
    points = [(x, v) for x, v in zip(xs, limit["level"], strict=True) if v is not None]
    axis.step([p[0] for p in points], [p[1] for p in points], where="post",
              color=LEVEL_COLOUR, label="quota left")  # fmt: skip
    axis.axhline(limit["quota"], color="#999", linestyle="--", linewidth=1)
    if limit.get("queue"):
        axis.step(xs, limit["queue"], where="post", color=COLOURS["delayed"], label="queue")
    axis.set_ylabel(limit["name"])
    axis.legend(loc="upper right")
