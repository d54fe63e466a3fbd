"""``gateway simulate``: arrival patterns against a policy on a virtual clock, counted by hand,
and the page's bars and tables checked against the engine's own counters."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from gateway.policytest.arrivals import arrivals, parse_pattern
from gateway.replay.log_formats import ReadStats
from tests.support.policies import policy_for
from tests.support.traffic_logs import combined_line

ROOT = Path(__file__).resolve().parent.parent
NODELAY = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n    nodelay: true\n"
)
SHAPED = "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 2\n    max_delay: 3s\n"


def write_policy(tmp_path: Path, limits: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for("http://127.0.0.1:9") + "limits:\n" + limits)
    return path


def simulate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["simulate", "--json", *args]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def instants(text: str) -> list[int]:
    return [r.t_us for r in arrivals([parse_pattern(text)], (), ReadStats())]


def test_constant_rate_against_nginx_arithmetic_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2r/s for 10 s: 20 requests, every 500 ms, against 1r/s burst 2 nodelay. Each admitted
    # request adds 1000 milli-requests of excess and 500 ms leak 500: 0, 500, 1000, 1500,
    # 2000 admitted (2000 is not over the burst); from 2500 every other one would pass 2000,
    # rejected: 2500, 3500, ..., 9500 (8 of them).
    policy = write_policy(tmp_path, NODELAY)
    doc = simulate_json(capsys, str(policy), "--pattern", "constant:rate=2r/s,for=10s")
    assert doc["requests"] == 20
    assert doc["totals"] == {"admitted": 12, "delayed": 0, "rejected": 8, "other": 0}
    (limit,) = doc["limits"]
    assert limit["counters"]["allowed"] == 12 and limit["counters"]["rejected"] == 8
    assert limit["quota"] == 3
    assert limit["queue"] is None and limit["peak_queue"] == 0  # nodelay: nothing waits


def test_the_page_draws_what_the_engine_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, SHAPED)
    page = tmp_path / "sim.html"
    pattern = [
        "--pattern",
        "burst:size=6,every=5s,for=20s",
        "--pattern",
        "constant:rate=0.5r/s,for=20s,start=2500ms",
    ]
    assert main(["simulate", str(policy), *pattern, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    text = page.read_text(encoding="utf-8")
    embedded = re.search(r'id="simulate-data">(.*?)</script>', text)
    assert embedded is not None
    doc = json.loads(embedded.group(1))
    counters = doc["limits"][0]["counters"]
    # The bars: each step's count per group, summed, is the engine's count.
    drawn: Counter[str] = Counter()
    bars = re.findall(r'data-group="(\w+)" data-bin="\d+" data-count="(\d+)"', text)
    for group, count in bars:
        drawn[group] += int(count)
    assert drawn["admitted"] == counters["allowed"]
    assert drawn["delayed"] == counters["delayed"]
    assert drawn["rejected"] == counters["rejected"]
    assert sum(drawn.values()) == doc["requests"] == 34
    assert counters["delayed"] > 0 and counters["rejected"] > 0  # the pattern shows both
    # The tables say the same, and so does the text report.
    row = f"<td>per_ip</td><td>leaky_bucket</td><td>{counters['allowed']}</td>"
    assert row + f"<td>{counters['delayed']}</td><td>{counters['rejected']}</td>" in text
    assert (
        f"per_ip [leaky_bucket]: admitted {counters['allowed']}, delayed "
        f"{counters['delayed']}, rejected {counters['rejected']}"
    ) in out
    # The level: each burst empties the bucket (0 left), and it refills between bursts.
    level = doc["limits"][0]["level"]
    assert min(v for v in level if v is not None) == 0
    assert max(v for v in level if v is not None) >= 2
    assert 'data-chart="level" data-limit="per_ip"' in text and "<polyline" in text
    # The queue drawn from each delayed request's wait peaks where the engine's own count of
    # waiting requests did: a burst of 6 at 1r/s, burst 2, max_delay 3s leaves 2 waiting.
    limit = doc["limits"][0]
    assert max(limit["queue"]) == limit["peak_queue"] == 2
    assert f'data-series="queue" data-peak="{limit["peak_queue"]}"' in text
    assert " src=" not in text and " href=" not in text  # self-contained: it opens offline


def test_patterns_are_exact_and_deterministic() -> None:
    assert instants("constant:rate=10r/s,for=1s") == [i * 100_000 for i in range(10)]
    assert (
        instants("burst:size=3,every=2s,for=5s,start=1s")
        == [1_000_000] * 3 + [3_000_000] * 3 + [5_000_000] * 3
    )
    ramp = instants("ramp:from=0r/s,to=10r/s,for=10s")
    assert len(ramp) == 50  # the rate's integral: 10 / 2 * 10
    gaps = [b - a for a, b in itertools.pairwise(ramp)]
    assert gaps == sorted(gaps, reverse=True)  # ever closer
    poisson = instants("poisson:rate=20r/s,for=10s,seed=7")
    assert poisson == instants("poisson:rate=20r/s,for=10s,seed=7")
    assert poisson != instants("poisson:rate=20r/s,for=10s,seed=8")
    assert 150 < len(poisson) < 250 and poisson == sorted(poisson)


def test_a_log_as_the_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "access.log"
    log.write_text("".join(combined_line("203.0.113.1", 100) for _ in range(4)))
    policy = write_policy(tmp_path, NODELAY)
    doc = simulate_json(capsys, str(policy), "--pattern", f"log:{log}")
    # Four requests in one second (spread 250 ms apart): the fourth passes the burst.
    assert doc["totals"] == {"admitted": 3, "delayed": 0, "rejected": 1, "other": 0}
    assert doc["first_ms"] == 0 and doc["span_ms"] == 750


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("steady:rate=1r/s", "unknown pattern 'steady'"),
        ("constant:rate=1r/s", "a constant pattern needs for"),
        ("burst:size=3,every=0s,for=1s", "every must be longer than 0"),
        ("constant:rate=fast,for=1s", "invalid rate 'fast'"),
        ("constant:rate=1r/s,for=1s,colour=red", "a constant pattern takes rate, for"),
    ],
)
def test_a_bad_pattern_is_one_line(pattern: str, reason: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "simulate", "p.yaml", "--pattern", pattern],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert reason in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed"
)
def test_png_without_matplotlib_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, NODELAY)
    args = ["simulate", str(policy), "--pattern", "constant:rate=1r/s,for=1s"]
    assert main([*args, "--png", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == (
        "gateway simulate: --png needs matplotlib, which is not installed: pip install "
        "matplotlib (or 'rl-gateway[bench]'), or use --html\n"
    )


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_png_is_drawn_when_matplotlib_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write_policy(tmp_path, SHAPED)
    png = tmp_path / "x.png"
    args = ["simulate", str(policy), "--pattern", "burst:size=6,every=5s,for=20s"]
    assert main([*args, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_policies_compared_under_the_same_requests_on_one_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nodelay").mkdir()
    nodelay = write_policy(tmp_path / "nodelay", NODELAY)
    shaped = write_policy(tmp_path, SHAPED)
    page = tmp_path / "sim.html"
    pattern = ["--pattern", "burst:size=6,every=5s,for=20s"]
    args = ["simulate", str(shaped), "--compare", str(nodelay), *pattern, "--html", str(page)]
    assert main(args) == 0
    out = capsys.readouterr().out
    # A burst of 6 at 1r/s, burst 2, four times: nodelay admits 3 at once and rejects 3;
    # shaping admits 1, delays 2 (max_delay 3s) and rejects 3.
    assert "admitted at once 4, delayed 8, rejected 12, refused otherwise 0\n" in out
    assert "compared with\n" in out
    assert out.endswith(
        "admitted at once 12, delayed 0, rejected 12, refused otherwise 0\n"
        "  per_ip [leaky_bucket]: admitted 12, delayed 0, rejected 12\n"
    )
    text = page.read_text(encoding="utf-8")
    charts = re.findall(r'data-chart="requests" data-step-ms="\d+" data-peak="(\d+)"', text)
    assert charts == ["6", "6"]  # one scale for both
    sections = text.split("<section>")[1:]
    assert len(sections) == 2 and str(nodelay) in sections[1]
    for section, admitted, delayed in ((sections[0], 4, 8), (sections[1], 12, 0)):
        drawn: Counter[str] = Counter()
        for group, count in re.findall(
            r'data-group="(\w+)" data-bin="\d+" data-count="(\d+)"', section
        ):
            drawn[group] += int(count)
        assert (drawn["admitted"], drawn["delayed"], drawn["rejected"]) == (admitted, delayed, 12)
