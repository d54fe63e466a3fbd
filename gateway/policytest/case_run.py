"""Test cases run on the real engine with a virtual clock, and what they found as a diff.

Each case starts from nothing (a fresh ``Simulation``: the engine, the in-process store and
the routes the gateway builds, on a ``FakeClock``) and sends its steps' requests at their
instants through ``Simulation.decide``, the path replay takes and the proxy's. What each
request met is written as one line beside the expected line (only the fields the case
names), so a failure is a unified diff of expected against actual.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Final

from gateway.engine.limit_engine import Outcome
from gateway.policy.loader import LoadedPolicy
from gateway.policytest.cases import US, Counts, Expectation, LoadedCases, Step, format_ms
from gateway.replay.log_formats import Request
from gateway.replay.simulate import DELAYED, DENIED, REJECTED, UNROUTED, Simulation

FORWARDED: Final = 200  # the status a case expects of a request the gateway forwards
# Context lines around each difference.
DIFF_CONTEXT: Final = 2


@dataclass(frozen=True, slots=True)
class Observed:
    """What one request met, as a client would see it (the upstream's own answer aside)."""

    t_us: int
    what: str  # simulate's outcome: allowed, delayed, rejected, denied, unlimited, unrouted
    status: int
    delay_us: int
    rejected_by: str | None
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        lower = name.lower()
        values = [value for key, value in self.headers if key.lower() == lower]
        return ", ".join(values) if values else None


@dataclass
class CaseResult:
    name: str
    requests: int = 0
    expected: list[str] = field(default_factory=list)
    actual: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.expected == self.actual

    def diff(self) -> list[str]:
        return list(
            difflib.unified_diff(
                self.expected, self.actual, "expected", "actual", lineterm="", n=DIFF_CONTEXT
            )
        )


def observe(simulation: Simulation, request: Request, client_ip: str) -> Observed:
    """Decide one request and say what its client would have been answered."""
    what = simulation.decide(request, client_ip)
    outcome = simulation.last
    engine = simulation.engine
    t_us = request.t_us
    if what == UNROUTED:
        return Observed(t_us, what, 404, 0, None, ())
    if what == DENIED:
        if outcome is None:  # refused before routing: CONNECT, or a target the proxy refuses
            return Observed(t_us, what, 405 if request.method == "CONNECT" else 400, 0, None, ())
        return Observed(t_us, what, outcome.status, 0, None, _denial_headers(outcome))
    if what == REJECTED and outcome is not None:
        headers = tuple(engine.headers(outcome))
        return Observed(t_us, what, outcome.status, 0, outcome.rejected_by, headers)
    headers = ()
    delay_us = 0
    if outcome is not None:
        delay_us = round(outcome.delay_s * US)
        if outcome.verdict is not None:
            headers = tuple(engine.headers(outcome))
    return Observed(t_us, what, FORWARDED, delay_us, None, headers)


def _denial_headers(outcome: Outcome) -> tuple[tuple[str, str], ...]:
    """An address denied or a store down: ``Retry-After`` when the refusal gives one."""
    if outcome.retry_after_s > 0.0:
        seconds = max(1, math.ceil(outcome.retry_after_s))
        return (("Retry-After", str(seconds)),)
    return ()


def run_case(loaded: LoadedPolicy, cases: LoadedCases, index: int) -> CaseResult:
    """One case from a fresh engine: its expected and actual lines."""
    case = cases.cases[index]
    simulation = Simulation(loaded)
    result = CaseResult(case.name)
    now_us = 0
    for number, step in enumerate(case.steps, 1):
        if step.at is not None:
            now_us = round(step.at * US)
        observed = []
        request = _request_of(step, cases.file, cases.step_line(index, number - 1) or 0)
        client_ip = _client_ip(simulation, step)
        gap = step.gap_us()
        for i in range(step.repeat):
            t_us = now_us + i * gap
            observed.append(observe(simulation, request.at(t_us), client_ip))
        now_us += (step.repeat - 1) * gap
        result.requests += step.repeat
        where = f"step {number} (line {cases.step_line(index, number - 1)})"
        _compare_step(result, where, step, observed)
    simulation.finish()
    return result


def _request_of(step: Step, file: str, line: int) -> Request:
    spec = step.request
    return Request(
        0,
        file,
        line,
        spec.client_ip,
        spec.method.upper(),
        spec.path,
        spec.host,
        tuple(spec.headers.items()),
        None,
        duration_us=-1 if spec.duration is None else round(spec.duration * US),
    )


def _client_ip(simulation: Simulation, step: Step) -> str:
    """The client as the proxy resolves it: the peer, or past trusted proxies the header."""
    resolver = simulation.resolver
    peer = step.request.client_ip
    forwarded: list[str] = []
    if resolver.is_trusted(peer):
        wanted = resolver.header_name.lower()
        forwarded = [v for k, v in step.request.headers.items() if k.lower() == wanted]
    return resolver.resolve(peer, forwarded)


def _compare_step(result: CaseResult, where: str, step: Step, observed: list[Observed]) -> None:
    total = len(observed)
    for i, seen in enumerate(observed):
        expectations = [e for e in (step.expect,) if e is not None]
        if i == total - 1 and step.expect_last is not None:
            expectations.append(step.expect_last)
        for expectation in expectations:
            head = f"{where} request {i + 1}/{total} at {format_ms(seen.t_us)}: "
            expected, actual = _lines(expectation, seen)
            result.expected.append(head + expected)
            result.actual.append(head + actual)
    if step.expect_counts is not None:
        expected, actual = _count_lines(step.expect_counts, observed)
        result.expected.append(f"{where}: {expected}")
        result.actual.append(f"{where}: {actual}")


def _lines(expectation: Expectation, seen: Observed) -> tuple[str, str]:
    """The fields the expectation names, as expected and as met."""
    expected: list[str] = []
    actual: list[str] = []
    if expectation.status is not None:
        expected.append(f"status {expectation.status}")
        actual.append(f"status {seen.status}")
    if expectation.delay is not None:
        expected.append(f"delay {format_ms(round(expectation.delay * US))}")
        actual.append(f"delay {format_ms(seen.delay_us)}")
    if expectation.rejected_by is not None:
        expected.append(f"rejected by {expectation.rejected_by}")
        actual.append(f"rejected by {seen.rejected_by or '(none)'}")
    for name, value in expectation.headers.items():
        met = seen.header(name)
        expected.append(f"{name}: {'(absent)' if value is None else value}")
        actual.append(f"{name}: {'(absent)' if met is None else met}")
    return ", ".join(expected), ", ".join(actual)


def _count_lines(counts: Counts, observed: list[Observed]) -> tuple[str, str]:
    met = {
        "admitted": sum(1 for o in observed if o.status == FORWARDED and o.what != DELAYED),
        "delayed": sum(1 for o in observed if o.what == DELAYED),
        "rejected": sum(1 for o in observed if o.what == REJECTED),
    }
    expected = []
    actual = []
    for name in ("admitted", "delayed", "rejected"):
        want = getattr(counts, name)
        if want is not None:
            expected.append(f"{name} {want}")
            actual.append(f"{name} {met[name]}")
    return ", ".join(expected), ", ".join(actual)


def run_cases(loaded: LoadedPolicy, cases: LoadedCases) -> list[CaseResult]:
    return [run_case(loaded, cases, index) for index in range(len(cases.cases))]


def report(results: list[CaseResult]) -> str:
    """PASS or FAIL per case, each failure's diff, and the tally."""
    out: list[str] = []
    for result in results:
        mark = "PASS" if result.passed else "FAIL"
        noun = "request" if result.requests == 1 else "requests"
        out.append(f"{mark} {result.name} ({result.requests} {noun})")
        if not result.passed:
            out.extend("    " + line for line in result.diff())
    failed = sum(1 for r in results if not r.passed)
    out.append(f"{len(results) - failed} passed, {failed} failed")
    return "\n".join(out) + "\n"
