"""bench/bench_scaling.py runs where CI runs (a smoke test, not a measurement): the store
alone at 1 and 2 processes in each variant, its table and JSON; the cores' layout says when
the machine is too small to mean anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import bench_scaling as bs

REPO_ROOT = Path(__file__).parent.parent


def test_the_layout_gives_each_role_cores_of_its_own_on_sixteen_and_warns_below() -> None:
    big = bs.Layout.of(range(16))
    assert (big.gateway, big.upstream, big.redis, big.wrk) == (
        list(range(8)),
        "8,9,10",
        "11",
        "12,13,14,15",
    )
    assert big.full
    assert big.gateway_cpus(4) == "0,1,2,3"
    small = bs.Layout.of([0, 1])
    assert not small.full
    assert small.gateway == [0]
    assert small.gateway_cpus(8) == "0"


def test_the_store_alone_runs_and_reports_each_variant(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_scaling.py"), "--store-only",
         "--workers", "1,2", "--store-seconds", "0.3", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    small = len(os.sched_getaffinity(0)) < bs.BIG_MACHINE_CORES
    assert ("say nothing about scaling" in result.stderr) == small
    runs = json.loads(out.read_text())["store_only"]
    assert [(run["workers"], run["variant"]) for run in runs] == [
        (1, "exact"), (1, "locked"), (1, "lease"), (2, "exact"), (2, "locked"), (2, "lease"),
    ]  # fmt: skip
    for run in runs:
        assert run["decisions_per_s"] > 0
        assert run["rejected"] == 0  # never-binding limits
        assert (run["from_lease_share"] > 0.5) == (run["variant"] == "lease")
    assert "| 2 | lease |" in result.stdout
