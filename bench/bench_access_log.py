"""The access log's cost per request on the event loop: one line formatted and written.

    python bench/bench_access_log.py --lines 50000 --rounds 5

Writes ``--lines`` lines for one request (``make_mocked_request``, an API key and a user agent)
through ``AccessLog.write`` in each setting: on stderr through logger ``gateway.access`` (what
``access_log: true`` did and does; the stream is /dev/null here, the terminal or the journal's
pipe in production), and to a file (in a temporary directory) as JSON, JSON with two header
fields (the API key hashed), and a combined-like template. Prints this thread's CPU time per
line, the median over ``--rounds``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp.test_utils import make_mocked_request  # noqa: E402

from gateway.edge.request_record import RequestRecord  # noqa: E402
from gateway.engine.preflight import parse_and_build  # noqa: E402
from gateway.log_setup import GatewayFormatter  # noqa: E402
from gateway.observability.access_log import AccessLog  # noqa: E402

TEMPLATE = (
    '$remote_addr - - [$time_local] "$request" $status - "$http_referer" "$http_user_agent" '
    "$msec $request_time $http_x_api_key"
)


def settings(tmp: Path) -> dict[str, str]:
    """Each setting measured: its ``server:`` lines."""
    return {
        "stderr json (access_log: true)": "  access_log: true\n  access_log_format: json\n",
        "file json": f"  access_log: {{path: {tmp}/a.log}}\n",
        "file json, 2 fields": (
            f"  access_log: {{path: {tmp}/b.log, fields: [X-Api-Key, User-Agent]}}\n"
        ),
        "file template": f"  access_log: {{path: {tmp}/c.log, format: '{TEMPLATE}'}}\n",
    }


def one_round(server: str, lines: int) -> float:
    policy = parse_and_build(
        "server:\n" + server + "upstreams:\n  b: {url: 'http://127.0.0.1:9'}\n"
        "routes:\n  - {name: all, upstream: b}\n",
        "bench.yaml",
    ).policy
    access_log = AccessLog()
    access_log.configure(policy)
    request = RequestRecord(
        make_mocked_request(
            "GET",
            "/api/items?page=2",
            headers={"Host": "example.test", "X-Api-Key": "k-0123456789", "User-Agent": "curl/8.5"},
        )
    )
    started = time.thread_time()
    for _ in range(lines):
        access_log.write(request, 200, 0.0042, "all", None, None, 123_456_789)
    spent = time.thread_time() - started
    access_log.close()
    return spent / lines * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with open("/dev/null", "w") as devnull, tempfile.TemporaryDirectory() as tmp:
        handler = logging.StreamHandler(devnull)
        handler.setFormatter(GatewayFormatter("text"))
        logging.basicConfig(level="INFO", handlers=[handler], force=True)
        for name, server in settings(Path(tmp)).items():
            figures = [one_round(server, args.lines) for _ in range(args.rounds)]
            print(f"{name:32} {statistics.median(figures):6.2f} µs per line")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
