"""``gateway suggest`` on a generated log of a million lines: wall and CPU time.

    python bench/bench_suggest.py --normal 5000 --span 3600

Writes an nginx ``combined`` log of well-behaved clients and three abusive ones
(``tests/support/traffic_logs.py``; some 950,000 lines for the defaults) into a temporary
directory (not timed), then runs ``gateway suggest`` on it in process: reading, measuring,
proposing, writing and checking the policy, and its proof (the policy replayed on the log).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.cli.main import main  # noqa: E402
from tests.support.traffic_logs import combined_log  # noqa: E402


def run(normal: int, span: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "access.log"
        population = combined_log(log, normal=normal, span_s=span)
        out = io.StringIO()
        wall, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(out):
            status = main(["suggest", str(log), "-o", str(Path(directory) / "p.yaml")])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert status == 0, out.getvalue()
        print(out.getvalue(), end="")
        print(
            f"{population.requests:,} lines: {wall:.1f} s wall, {cpu:.1f} s CPU "
            f"({population.requests / wall:,.0f} lines/s)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--normal", type=int, default=5000, help="well-behaved clients")
    parser.add_argument("--span", type=int, default=3600, help="seconds of traffic")
    args = parser.parse_args()
    run(args.normal, args.span)
