"""``gateway suggest``: limits proposed from logs of known populations (well-behaved clients
and a few abusive ones) refuse the abusive keys and at most the chosen share of the others,
in nginx ``combined``, JSON lines with API keys, and the gateway's own log; the written
policy passes ``gateway check``; the proof is the replay of it; the numbers are exact."""

from __future__ import annotations

import re
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.engine.preflight import load_and_build
from gateway.suggest.proof import prove
from gateway.suggest.proposal import choose
from gateway.suggest.traffic import leaky_need, measure, peak_in_window
from tests.support.traffic_logs import (
    Population,
    combined_line,
    combined_log,
    gateway_log,
    json_lines_log,
)

ROOT = Path(__file__).resolve().parent.parent


def suggest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, log: Path, *options: str
) -> tuple[Path, str]:
    policy = tmp_path / "suggested.yaml"
    assert main(["suggest", str(log), "-o", str(policy), *options]) == 0
    return policy, capsys.readouterr().out


def refused_clients(policy: Path, log: Path) -> set[str]:
    """Who the policy refuses, replayed through the engine (as ``gateway replay`` would)."""
    proof = prove(load_and_build(policy), [str(log)], "auto")
    return set().union(*(set(keys) for keys in proof.refused.values()))


def assert_refuses_the_abusive(refused: set[str], population: Population, share: float) -> None:
    assert set(population.abusive) <= refused
    normal_refused = refused & set(population.normal)
    assert len(normal_refused) <= share * len(population.normal)


@pytest.mark.parametrize("writer", [combined_log, gateway_log], ids=["combined", "gateway"])
def test_the_proposal_refuses_the_abusive_clients_and_few_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: object
) -> None:
    log = tmp_path / "access.log"
    population = writer(log, span_s=900)  # type: ignore[operator]
    page = tmp_path / "evidence.html"
    policy, out = suggest(capsys, tmp_path, log, "--reject-at-most", "2%", "--html", str(page))
    assert_refuses_the_abusive(refused_clients(policy, log), population, 0.02)
    # The page draws the chosen burst as the line through every client's need, the clients
    # above it refused.
    burst = re.search(r"  per_ip:\n(?:    .*\n)*?    burst: (\d+)\n", policy.read_text())
    assert burst is not None
    drawn = re.search(
        r'data-limit="per_ip" data-setting="burst" data-threshold="(\d+)" data-refused="(\d+)"',
        page.read_text(),
    )
    assert drawn is not None and drawn.group(1) == burst.group(1)
    assert int(drawn.group(2)) >= len(population.abusive)
    # The report's proof names them, with when.
    for ip in population.abusive:
        assert f"    {ip}: " in out and " UTC" in out
    # The written policy is what gateway check accepts.
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(policy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # ... and its tests beside it, which check ran.
    assert "per_ip admits a burst of" in (tmp_path / "suggested.tests.yaml").read_text()
    assert done.stdout.endswith("1 passed, 0 failed\n")
    # Each number under its evidence.
    text = policy.read_text()
    assert "# 203 clients; requests in their busiest minute: p50" in text
    assert "the heaviest: 203.0.113." in text
    assert "per_ip:\n    algorithm: leaky_bucket\n" in text
    assert "global:\n    algorithm: token_bucket\n" in text


def test_api_keys_get_a_limit_of_their_own_shown_by_their_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.jsonl"
    population = json_lines_log(log, span_s=900)
    policy, out = suggest(capsys, tmp_path, log, "--reject-at-most", "2%")
    text = policy.read_text()
    assert "  per_api_key:\n    algorithm: leaky_bucket\n" in text
    assert "key: [header:X-Api-Key]\n    on_missing_key: skip\n" in text
    assert "key-abusive" not in text and "key-abusive" not in out  # secrets: hashes only
    proof = prove(load_and_build(policy), [str(log)], "auto")
    assert len(proof.refused["per_api_key"]) >= len(population.abusive)
    assert all(key.startswith("sha256:") for key in proof.refused["per_api_key"])


def test_the_same_logs_give_the_same_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.log"
    combined_log(log, normal=50, span_s=600)
    first, _ = suggest(capsys, tmp_path, log)
    text = first.read_text()
    cases = (tmp_path / "suggested.tests.yaml").read_text()
    (tmp_path / "suggested.tests.yaml").unlink()
    second, _ = suggest(capsys, tmp_path, log)
    assert second.read_text() == text
    assert (tmp_path / "suggested.tests.yaml").read_text() == cases


def test_protect_upstream_sets_the_global_rate_and_the_proof_counts_its_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.log"
    combined_log(log, normal=50, abusive=0, span_s=600, flood_per_s=0.0001)
    policy, out = suggest(capsys, tmp_path, log, "--protect-upstream", "1r/s")
    assert "  global:\n    algorithm: token_bucket\n    rate: 60r/m\n    burst: 1\n" in (
        policy.read_text()
    )
    assert "  global: " in out.split("proof")[1]  # the upstream's limit refuses some


def test_the_numbers_are_exact() -> None:
    times = array("q", [0, 100, 200, 1000, 1050, 5000])
    assert peak_in_window(times, 500) == 3  # 0, 100, 200
    assert peak_in_window(times, 1000) == 4  # 100, 200, 1000, 1050 (0 is a window earlier)
    assert peak_in_window(times, 10_000) == 6
    # 1r/s (1000 milli): excess 0; 100: 0 - 100 + 1000 = 900; 200: 900 - 100 + 1000 = 1800;
    # 1000: 1800 - 800 + 1000 = 2000; 1050: 2000 - 50 + 1000 = 2950; 5000: 0 -> burst 3.
    assert leaky_need(times, 1000) == 3
    # Ten keys needing 1..10: 10% refuses the one above 9; 1 and 100: the gap.
    assert choose(list(range(1, 11)), 0.1).value == 9
    line = choose([1, 1, 2, 2, 3, 3, 3, 3, 60, 80], 0.3)
    assert (line.value, line.refused, line.by_gap) == (3, 2, True)
    assert choose([5, 6], 0.0).value == 6  # no share: nobody refused


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "suggest", *args, "-o", str(tmp_path / "p.yaml")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = run(str(tmp_path / "missing.log"))
    assert done.returncode == 1 and done.stderr.startswith("gateway suggest: ")
    assert done.stderr.count("\n") == 1
    done = run("x.log", "--reject-at-most", "lots")
    assert done.returncode == 2 and "expected a share such as 1% or 0.01" in done.stderr
    assert "Traceback" not in done.stderr


def test_ipv6_clients_are_measured_by_the_prefix_a_limit_keys(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text(
        combined_line("2001:db8::1", 0) + combined_line("2001:db8::2", 1)
        + combined_line("192.0.2.1", 2)
    )  # fmt: skip
    traffic = measure([str(log)], "auto", "X-Api-Key")
    assert {k: len(v) for k, v in traffic.by_client.items()} == {
        "2001:db8::/64": 2,
        "192.0.2.1": 1,
    }
    assert {k: len(v) for k, v in traffic.by_prefix.items()} == {"/": 3}


def test_a_share_of_the_requests_is_counted_as_the_engine_refuses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.log"
    combined_log(log, normal=100, abusive=1, span_s=600, flood_per_s=0.5)
    policy, out = suggest(capsys, tmp_path, log, "--reject-at-most", "2%", "--of", "requests")
    said = re.search(
        r"the least at which at most 2% of the requests \(([\d,]+) of ([\d,]+)\) are refused: "
        r"([\d,]+)\.",
        " ".join(line.strip("# ") for line in policy.read_text().splitlines()),
    )
    assert said is not None
    budget, total, refused = (int(g.replace(",", "")) for g in said.groups())
    proof = prove(load_and_build(policy), [str(log)], "auto")
    assert proof.requests == total and proof.rejected == refused <= budget
    assert refused > 0  # the flood is refused, as far as the share allows
    assert f"proof (the policy replayed on the same logs): {refused} of" in out.replace(",", "")


def test_cases_of_the_users_own_beside_the_policy_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.log"
    combined_log(log, normal=20, abusive=1, span_s=300)
    mine = tmp_path / "suggested.tests.yaml"
    mine.write_text("cases:\n  - name: mine\n    steps:\n      - request: {path: /}\n")
    policy = tmp_path / "suggested.yaml"
    assert main(["suggest", str(log), "-o", str(policy), "--reject-at-most", "10%"]) == 0
    captured = capsys.readouterr()
    assert (
        f"gateway suggest: {mine} exists: kept as it is (suggest writes it only when there "
        "is none)\n"
    ) in captured.err
    assert mine.read_text().startswith("cases:\n  - name: mine")
    assert "PASS mine (1 request)" in captured.out
