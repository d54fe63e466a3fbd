"""``gateway test POLICY CASES.yaml``: cases run on the real engine with a virtual clock; a pass,
a failure's exact diff, JUnit XML, invalid cases files, and ``gateway check`` running the cases
that sit beside a policy."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gateway.cli.main import main
from tests.support.policies import policy_for

ROOT = Path(__file__).resolve().parent.parent

# nginx limit_req arithmetic (tests/test_replay.py works it by hand): 1r/s, burst 2.
LIMITS = (
    "limits:\n"
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n    nodelay: true\n"
    "    match:\n      routes: [api]\n"
    "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n"
    "    match:\n      routes: [slow]\n"
)


def write_policy(tmp_path: Path, name: str = "policy.yaml") -> Path:
    text = policy_for("http://127.0.0.1:9").replace(
        "routes:\n  - name: all\n    upstream: backend\n",
        "routes:\n  - name: api\n    upstream: backend\n    match:\n      path_prefix: /api\n"
        "  - name: slow\n    upstream: backend\n    match:\n      path_prefix: /slow\n",
    )
    path = tmp_path / name
    path.write_text(text + LIMITS)
    return path


PASSING = """\
cases:
  - name: three at once pass, the fourth is refused
    steps:
      - request: {path: /api/items, client_ip: 203.0.113.7}
        repeat: 4
        expect_counts: {admitted: 3, rejected: 1}
        expect_last:
          status: 429
          rejected_by: per_ip
          headers: {Retry-After: 1, RateLimit-Policy: '"per_ip";q=3;w=3'}
      - at: 5s
        request: {path: /api/items, client_ip: 203.0.113.7}
        expect: {status: 200, delay: 0ms}
      - request: {path: /api/items, client_ip: 198.51.100.1}
        expect: {status: 200}
  - name: without nodelay the excess waits
    steps:
      - request: {path: /slow, client_ip: 203.0.113.7}
        repeat: 3
        every: 250ms
        expect_counts: {admitted: 1, delayed: 2}
      - at: 750ms
        request: {path: /slow, client_ip: 203.0.113.7}
        expect: {status: 429, headers: {Retry-After: 1}}
      - at: 2s
        request: {path: /slow, client_ip: 203.0.113.7}
        expect: {delay: 1000ms}  # excess 1500 - 1500 + 1000: 1 s at 1r/s
  - name: no route is the gateway's 404
    steps:
      - request: {path: /nowhere}
        expect: {status: 404, headers: {RateLimit: null}}
"""

FAILING = """\
cases:
  - name: the limit holds
    steps:
      - request: {path: /api}
        repeat: 4
        rate: 10r/s
        expect: {status: 200}
  - name: counted
    steps:
      - request: {path: /slow}
        repeat: 2
        expect_counts: {admitted: 2, delayed: 0}
"""

FAILING_REPORT = """\
FAIL the limit holds (4 requests)
    --- expected
    +++ actual
    @@ -2,3 +2,3 @@
     step 1 (line 4) request 2/4 at 100ms: status 200
     step 1 (line 4) request 3/4 at 200ms: status 200
    -step 1 (line 4) request 4/4 at 300ms: status 200
    +step 1 (line 4) request 4/4 at 300ms: status 429
FAIL counted (2 requests)
    --- expected
    +++ actual
    @@ -1 +1 @@
    -step 1 (line 10): admitted 2, delayed 0
    +step 1 (line 10): admitted 1, delayed 1
0 passed, 2 failed
"""


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cases_that_hold_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write_policy(tmp_path)
    cases = tmp_path / "cases.yaml"
    cases.write_text(PASSING)
    status, out, err = run(capsys, "test", str(policy), str(cases))
    assert (status, err) == (0, "")
    assert out == (
        "PASS three at once pass, the fourth is refused (6 requests)\n"
        "PASS without nodelay the excess waits (5 requests)\n"
        "PASS no route is the gateway's 404 (1 request)\n"
        "3 passed, 0 failed\n"
    )


def test_cases_that_fail_print_the_diff_of_expected_and_actual(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path)
    cases = tmp_path / "cases.yaml"
    cases.write_text(FAILING)
    status, out, err = run(capsys, "test", str(policy), str(cases))
    assert (status, err) == (1, "")
    assert out == FAILING_REPORT


def test_junit_xml_names_each_case_and_holds_each_failures_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path)
    cases = tmp_path / "cases.yaml"
    cases.write_text(FAILING + PASSING.removeprefix("cases:\n"))
    junit = tmp_path / "results.xml"
    status, _, _ = run(capsys, "test", str(policy), str(cases), "--junit", str(junit))
    assert status == 1
    root = ET.parse(junit).getroot()
    assert (root.tag, root.get("tests"), root.get("failures")) == ("testsuites", "5", "2")
    testcases = root.findall("./testsuite/testcase")
    assert [t.get("name") for t in testcases] == [
        "the limit holds",
        "counted",
        "three at once pass, the fourth is refused",
        "without nodelay the excess waits",
        "no route is the gateway's 404",
    ]
    failure = testcases[0].find("failure")
    assert failure is not None and failure.text is not None
    assert "+step 1 (line 4) request 4/4 at 300ms: status 429" in failure.text
    assert failure.get("message") == (
        "expected and actual differ: step 1 (line 4) request 4/4 at 300ms: status 429"
    )
    assert all(t.find("failure") is None for t in testcases[2:])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "cases:\n  - name: a\n    steps:\n      - request: {path: /, client: 1.2.3.4}\n",
            "cases.yaml:4: cases[0].steps[0].request.client: unknown key: did you mean "
            "`client_ip`?",
        ),
        (
            "cases:\n  - name: a\n    steps:\n      - repeat: many\n",
            "cases.yaml:4: cases[0].steps[0].repeat: expected a whole number, got 'many'",
        ),
        (
            "cases:\n  - name: a\n    steps:\n      - every: 1s\n        rate: 10r/s\n",
            "cases.yaml:4: cases[0].steps[0]: give every or rate, not both: rate 10r/s is "
            "every 100ms",
        ),
        (
            "cases:\n  - name: a\n    steps:\n      - at: 2s\n      - at: 1s\n",
            "cases.yaml:5: cases[0].steps[1].at: 1000ms is before the previous step's last "
            "request (2000ms): steps go forward in time",
        ),
        (
            "cases:\n  - name: a\n    steps: []\n",
            "cases.yaml:3: cases[0].steps: is empty: give at least 1",
        ),
        (
            "cases: [\n",
            "cases.yaml:2: invalid YAML: expected the node content, but found '<stream end>'",
        ),
    ],
)
def test_an_invalid_cases_file_is_one_line_per_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    policy = write_policy(tmp_path)
    cases = tmp_path / "cases.yaml"
    cases.write_text(text)
    status, out, err = run(capsys, "test", str(policy), str(cases))
    assert (status, out) == (1, "")
    assert err == f"{tmp_path}/{message}\n"


def test_check_runs_the_tests_beside_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path)
    status, out, _ = run(capsys, "check", str(policy))
    assert status == 0 and out.count("\n") == 1  # none beside it: check as before

    (tmp_path / "policy.tests.yaml").write_text(PASSING)
    status, out, _ = run(capsys, "check", str(policy))
    assert status == 0
    assert out.splitlines()[1:] == [
        f"{tmp_path / 'policy.tests.yaml'}: the policy's tests",
        "PASS three at once pass, the fourth is refused (6 requests)",
        "PASS without nodelay the excess waits (5 requests)",
        "PASS no route is the gateway's 404 (1 request)",
        "3 passed, 0 failed",
    ]

    (tmp_path / "policy.tests.yaml").write_text(FAILING)
    status, out, _ = run(capsys, "check", str(policy))
    assert status == 1 and out.endswith(FAILING_REPORT)
    # --no-tests: what run accepts, and nothing more.
    status, out, _ = run(capsys, "check", "--no-tests", str(policy))
    assert status == 0 and out.count("\n") == 1


def test_check_of_a_glob_takes_a_cases_file_for_its_policys_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gateway check policies/*.yaml`` names the cases beside a policy too: they are that
    policy's cases (run once, with it), not a policy with an unknown key ``cases``."""
    policy = write_policy(tmp_path)
    cases = tmp_path / "policy.tests.yaml"
    cases.write_text(PASSING)
    status, out, err = run(capsys, "check", str(policy), str(cases))
    assert (status, err) == (0, "")
    assert out.count("PASS") == 3 and f"{cases}: the test cases of {policy}, run with it" in out
    status, out, err = run(capsys, "check", str(cases))  # alone: run with its policy
    assert (status, err, out.count("PASS")) == (0, "", 3)
    cases.write_text(FAILING)
    assert run(capsys, "check", str(cases))[0] == 1
    orphan = tmp_path / "other.tests.yaml"
    orphan.write_text(PASSING)
    status, out, err = run(capsys, "check", str(orphan))
    assert status == 1 and out == ""
    assert err == (
        f"{orphan}: test cases (the name ends in .tests.yaml), not a policy, and no other.yaml "
        f"beside them: run them with `gateway test POLICY {orphan}`\n"
    )


def test_a_client_behind_a_trusted_proxy_is_keyed_by_the_forwarded_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path)
    text = policy.read_text().replace("server:\n", "server:\n  trusted_proxies: [10.0.0.0/8]\n", 1)
    policy.write_text(text)
    cases = tmp_path / "cases.yaml"

    def behind_proxy(client: str) -> str:
        return (
            "      - request:\n          path: /api\n          client_ip: 10.0.0.1\n"
            f"          headers: {{X-Forwarded-For: {client}}}\n"
        )

    cases.write_text(
        "cases:\n  - name: two clients behind one proxy\n    steps:\n"
        + behind_proxy("203.0.113.1")
        + "        repeat: 3\n"
        + behind_proxy("203.0.113.2")
        + "        expect: {status: 200}\n"
        + behind_proxy("203.0.113.1")
        + "        expect: {status: 429}\n"
    )
    status, out, _ = run(capsys, "test", str(policy), str(cases))
    assert status == 0, out


def test_an_invalid_policy_or_a_missing_file_is_one_line_and_no_traceback(tmp_path: Path) -> None:
    policy = write_policy(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "test", str(policy), str(tmp_path / "none.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr == f"{tmp_path / 'none.yaml'}: cannot read: No such file or directory\n"


def test_the_shipped_default_policy_passes_its_tests(capsys: pytest.CaptureFixture[str]) -> None:
    policies = ROOT / "policies"
    status, out, err = run(
        capsys, "test", str(policies / "default.yaml"), str(policies / "default.tests.yaml")
    )
    assert (status, err) == (0, ""), out
    assert out.endswith("3 passed, 0 failed\n")


def test_a_concurrency_limits_slots_are_held_for_the_requests_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_for("http://127.0.0.1:9")
        + "limits:\n  in_flight:\n    algorithm: concurrency\n    limit: 1\n"
    )
    cases = tmp_path / "cases.yaml"
    cases.write_text(
        "cases:\n  - name: one at a time\n    steps:\n"
        "      - request: {path: /, duration: 1s}\n        expect: {status: 200}\n"
        "      - at: 500ms\n        request: {path: /}\n"
        "        expect: {status: 429, rejected_by: in_flight}\n"
        "      - at: 1s\n        request: {path: /}\n        expect: {status: 200}\n"
    )
    status, out, _ = run(capsys, "test", str(policy), str(cases))
    assert status == 0, out
