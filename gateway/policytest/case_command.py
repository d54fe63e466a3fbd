"""``gateway test POLICY CASES.yaml``, and the cases ``gateway check`` finds beside a policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from gateway.engine.preflight import load_and_build
from gateway.policy.loader import LoadedPolicy, PolicyError
from gateway.policytest.case_run import report, run_cases
from gateway.policytest.cases import load_cases
from gateway.policytest.junit import junit_xml

# ``policy.yaml``'s cases, beside it: ``policy.tests.yaml``.
SIBLING_SUFFIX: Final = ".tests.yaml"


def sibling_cases(policy_file: str | Path) -> Path | None:
    """The cases file that sits beside a policy, if there is one."""
    path = Path(policy_file)
    cases = path.with_name(path.stem + SIBLING_SUFFIX)
    return cases if cases.is_file() else None


def run_and_report(loaded: LoadedPolicy, cases_file: str, junit: str | None = None) -> int:
    """Run a cases file against a loaded policy: the report on stdout, 0 when all pass, 1
    when one fails or the file is invalid (its problems on stderr)."""
    try:
        cases = load_cases(cases_file)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    results = run_cases(loaded, cases)
    sys.stdout.write(report(results))
    if junit is not None:
        try:
            Path(junit).write_text(junit_xml(cases_file, loaded.source, results), encoding="utf-8")
        except OSError as exc:
            print(f"gateway test: {junit}: cannot write: {exc.strerror}", file=sys.stderr)
            return 1
    return 0 if all(result.passed for result in results) else 1


def main(policy_file: str, cases_file: str, junit: str | None = None) -> int:
    try:
        loaded = load_and_build(policy_file)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    return run_and_report(loaded, cases_file, junit)
