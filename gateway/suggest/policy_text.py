"""A proposal written as a policy file: each limit under the comments that say what its
numbers rest on, the whole a file ``gateway check`` accepts."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime

from gateway.suggest.proposal import Proposal

_WIDTH = 96


def _comment(text: str, indent: str) -> list[str]:
    return [
        f"{indent}# {line}"
        for line in textwrap.wrap(text, _WIDTH - len(indent) - 2, break_on_hyphens=False)
    ]


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def policy_text(proposal: Proposal, logs: list[str], upstream: str, unix_offset_ms: int = 0) -> str:
    first = proposal.first_ms + unix_offset_ms
    lines = _comment(
        f"Suggested by gateway suggest from {', '.join(logs)}: {proposal.requests:,} requests "
        f"from {proposal.clients:,} clients over {proposal.span_ms / 1000:,.0f} s "
        f"({_when(first)} to {_when(first + proposal.span_ms)}), refusing at most "
        f"{proposal.share * 100:g}% of the keys of each per-key limit at their peaks. Each "
        "limit's comments give the evidence; replay this file on the logs to see who would "
        "be refused, and when (gateway suggest does, and says so).",
        "",
    )
    lines += [
        "version: 1",
        "upstreams:",
        "  backend:",
        f"    url: {upstream}  # where the gateway forwards: your backend",
        "routes:",
        "  - name: all",
        "    upstream: backend",
        "limits:",
    ]
    for limit in proposal.limits:
        for sentence in limit.evidence:
            lines += _comment(sentence, "  ")
        lines.append(f"  {limit.name}:")
        lines += [f"    {name}: {value}" for name, value in limit.settings]
    return "\n".join(lines) + "\n"
