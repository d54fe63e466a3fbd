"""``gateway suggest LOG...``: measure, propose, write the policy, check it as ``gateway check``
does, prove it by replaying it on the same logs, and report."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gateway.engine.preflight import load_and_build
from gateway.policy.loader import PolicyError
from gateway.suggest.policy_text import cases_text, policy_text
from gateway.suggest.proof import Proof, prove
from gateway.suggest.proposal import Proposal, propose
from gateway.suggest.suggest_page import html_page
from gateway.suggest.traffic import LogError, measure

REFUSED_SHOWN = 10


def _when(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).strftime("%H:%M:%S")


def text(proposal: Proposal, proof: Proof, output: str, elapsed_s: float) -> str:
    out = [
        f"measured {proposal.requests:,} requests from {proposal.clients:,} clients"
        + (f" and {proposal.api_keys:,} API keys" if proposal.api_keys else "")
        + f" over {proposal.span_ms / 1000:,.0f} s; wrote {output} (gateway check: ok)",
    ]
    for proposed in proposal.limits:
        settings = ", ".join(f"{k} {v}" for k, v in proposed.settings if k != "algorithm")
        algorithm = dict(proposed.settings)["algorithm"]
        out.append(f"  {proposed.name} [{algorithm}]: {settings}")
    share = 100.0 * proof.rejected / max(proof.requests, 1)
    out.append(
        f"proof (the policy replayed on the same logs): {proof.rejected:,} of "
        f"{proof.requests:,} requests refused ({share:.2f}%)"
    )
    for limit, keys in proof.refused.items():
        ranked = sorted(keys.items(), key=lambda kv: (-kv[1].requests, kv[0]))
        out.append(f"  {limit}: {len(keys):,} keys refused")
        for key, record in ranked[:REFUSED_SHOWN]:
            out.append(
                f"    {key}: {record.requests:,} requests, from "
                f"{_when(record.first_us + proof.unix_offset_us)} to "
                f"{_when(record.last_us + proof.unix_offset_us)} UTC"
            )
        if len(ranked) > REFUSED_SHOWN:
            out.append(f"    ... and {len(ranked) - REFUSED_SHOWN:,} more")
    out.append(f"took {elapsed_s:.1f} s")
    return "\n".join(out) + "\n"


def main(
    logs: list[str],
    *,
    output: str,
    share: float,
    fmt: str = "auto",
    api_key_header: str = "X-Api-Key",
    protect_upstream: float | None = None,
    upstream: str = "http://127.0.0.1:8000",
    html_file: str | None = None,
    of_requests: bool = False,
) -> int:
    started = time.perf_counter()
    if logs.count("-"):
        print("gateway suggest: logs are read twice (to measure, then to prove): "
              "standard input ('-') cannot be", file=sys.stderr)  # fmt: skip
        return 1
    try:
        traffic = measure(logs, fmt, api_key_header)
    except LogError as exc:
        print(f"gateway suggest: {exc}", file=sys.stderr)
        return 1
    if not traffic.requests:
        print("gateway suggest: the logs hold no request to measure", file=sys.stderr)
        return 1
    proposal = propose(
        traffic,
        share,
        api_key_header=api_key_header,
        protect_upstream=protect_upstream,
        of_requests=of_requests,
    )
    offset_ms = (traffic.stats.unix_offset_us or 0) // 1000
    written = policy_text(proposal, logs, upstream, offset_ms)
    cases = cases_text(proposal)
    # Beside the policy, under the name gateway check reads (``POLICY.tests.yaml``).
    cases_file = Path(output).with_name(Path(output).stem + ".tests.yaml")
    if cases is not None and cases_file.exists():
        print(
            f"gateway suggest: {cases_file} exists: kept as it is (suggest writes it only "
            "when there is none)",
            file=sys.stderr,
        )
        cases = None
    try:
        Path(output).write_text(written, encoding="utf-8")
        if cases is not None:
            cases_file.write_text(cases, encoding="utf-8")
    except OSError as exc:
        print(f"gateway suggest: {exc.filename}: cannot write: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        loaded = load_and_build(output)
    except PolicyError as exc:  # a bug of ours: say so plainly, with the checker's words
        print(f"gateway suggest: the policy written does not pass check:\n{exc}", file=sys.stderr)
        return 1
    proof = prove(loaded, logs, fmt)
    if html_file is not None:
        try:
            Path(html_file).write_text(html_page(proposal, proof, output, written), "utf-8")
        except OSError as exc:
            print(f"gateway suggest: {html_file}: cannot write: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"gateway suggest: wrote {Path(html_file).resolve()}", file=sys.stderr)
    wrote = f"{output} and {cases_file}" if cases is not None else output
    sys.stdout.write(text(proposal, proof, wrote, time.perf_counter() - started))
    return 0
