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


def cases_text(proposal: Proposal) -> str | None:
    """Test cases of the proposal's per-client bucket, for ``gateway test`` and ``gateway
    check`` (written beside the policy): its burst passes at once, the next request is
    refused, and one more passes when a request's worth has drained. None when another limit
    would decide such a burst first (a window or a bucket smaller than it)."""
    settings = {limit.name: dict(limit.settings) for limit in proposal.limits}
    per_ip = settings.get("per_ip")
    if per_ip is None:
        return None
    burst = int(per_ip["burst"])
    count, unit = per_ip["rate"].split("r/")
    rate_milli = int(count) * 1000 // (60 if unit == "m" else 1)
    sent = burst + 2
    for name, other in settings.items():
        if name.startswith("prefix_") or name == "per_ip":
            continue  # the cases send to /, which no prefix limit matches
        # The cases charge every limit on / with burst + 3 requests (the refused one with
        # nothing): a window or bucket with less room would decide some of them first.
        room = int(other.get("limit", other.get("burst", sent + 1)))
        if room < sent + 1:
            return None
    drained_ms = -(-1_000_000 // rate_milli)  # one request's worth, nginx's arithmetic
    lines = [
        "# The tests of the suggested policy beside this file: gateway check runs them. Add",
        "# your own; gateway suggest writes this file only when there is none.",
        "cases:",
        f"  - name: per_ip admits a burst of {burst + 1} at once and refuses the next",
        "    steps:",
        "      - request: {path: /, client_ip: 192.0.2.1}",
        f"        repeat: {sent}",
        f"        expect_counts: {{admitted: {burst + 1}, rejected: 1}}",
        "        expect_last: {status: 429, rejected_by: per_ip}",
        f"      - at: {drained_ms}ms  # one request drained at {per_ip['rate']}",
        "        request: {path: /, client_ip: 192.0.2.1}",
        "        expect: {status: 200}",
        "      - request: {path: /, client_ip: 192.0.2.2}",
        "        expect: {status: 200}  # another client has a bucket of its own",
    ]
    return "\n".join(lines) + "\n"
