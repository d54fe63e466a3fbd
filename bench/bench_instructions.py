"""Instructions per request of a gateway worker, counted by valgrind (callgrind): the cost of a
limit in a figure that machine load does not move, for before/after comparisons on a shared
machine where req/s and even CPU time wander by 10% from one run to the next.

    python bench/bench_instructions.py --requests 2000
    python bench/bench_instructions.py --requests 2000 --baseline-root ../before

For each policy of ``limit_policies`` (no limits, one never-binding limit, three stacked, in
process) it starts ``bench/upstream.py`` and one gateway worker under callgrind, sends some
requests to warm it, zeroes the counters, sends ``--requests`` keep-alive requests one at a
time, and dumps the count, with the worker's once-a-second observability tick held off (its
share of a request grows with how slowly valgrind runs; ``--with-tick`` leaves it on).
Printed: instructions per request, and the difference to the gateway with no limits.
``--baseline-root`` counts another checkout's gateway the same way.

What it does not show: instructions are not time (a cache miss costs hundreds of cycles and
counts as one), and one request at a time has no concurrency (no batches of ready
connections, hardly any garbage collection). It is the figure for "did this change make the
request path do less", next to ``bench_proxy.py``'s req/s, p99 and CPU per request. Needs
valgrind (Debian's ``valgrind`` package).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from limit_policies import (  # noqa: E402
    ADAPTIVE,
    NO_LIMITS,
    ONE_LIMIT,
    THREE_AND_CONCURRENCY,
    THREE_LIMITS,
    policy_text,
)

HOST = "127.0.0.1"
KINDS = (NO_LIMITS, ONE_LIMIT, THREE_LIMITS)
# Counted when named (--kinds): one request at a time never reaches either limit, so these count
# what the concurrency limit and the adaptive controller cost a request that passes them.
MORE_KINDS = (THREE_AND_CONCURRENCY, ADAPTIVE)
WARM_REQUESTS = 300
START_TIMEOUT_S = 600.0  # a Python start under valgrind takes tens of seconds, minutes when loaded


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_serving(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            send(port, 1)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"not serving on {port} after {timeout_s:.0f} s")


def send(port: int, requests: int) -> None:
    """``requests`` GETs on one keep-alive connection, one at a time."""
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        for _ in range(requests):
            conn.request("GET", "/api/items")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"got {response.status}")
    finally:
        conn.close()


@contextmanager
def running(
    argv: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The metrics snapshot runs once a second, not once a request: under callgrind a request takes
# some 50 times as long, so the snapshot (and the rest of the timed work) lands on far more
# requests than in a real run, and on more still when the machine is loaded. The handler's
# inclusive cost (the request's own work) is the figure load does not move; compiled, both are
# named functions: the proxy's ``serve_record`` (``__call__`` in builds before it).
HANDLERS = (
    "CPyDef_proxy___serve_record_ProxyHandler_gen_____mypyc_generator_helper__ ",
    "CPyDef_proxy_____call___3_ProxyHandler_gen_____mypyc_generator_helper__ ",
)

# The once-a-second tick (rotating the metrics, the snapshot, publishing it from a thread) runs
# once per second of valgrind's slow time, so its share of a request moves with the machine's
# load: the totals of one build moved by 20,000 instructions a request between two runs
# (bench/README.md, "aiohttp's per-request machinery"). Held off unless ``--with-tick``: a
# ``sitecustomize`` on the gateway's path moves the tick's period out of the measurement.
HOLD_OFF_TICK = """\
import os
import sys

try:
    sys.path.insert(0, os.getcwd())
    import gateway.observability.observer as _observer

    _observer.TICK_S = 1e7
except Exception:
    pass
finally:
    del sys.path[0]
"""
SNAPSHOT = "CPyDef_worker___WorkerMetrics___snapshot "


def named_shares(dump: Path, requests: int) -> tuple[float | None, float | None]:
    """Instructions per request in the handler and in the metrics snapshot, inclusive (None:
    the pure build, where they are not named)."""
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found: dict[str, float] = {}
    for line in annotated.splitlines():
        for name in (*HANDLERS, SNAPSHOT):
            if ":" + name in line and "__native_" in line and name not in found:
                found[name] = int(line.split()[0].replace(",", "")) / requests
    handler = next((found[name] for name in HANDLERS if name in found), None)
    return handler, found.get(SNAPSHOT)


def count(
    root: Path, kind: str, upstream: str, requests: int, work: Path, tick: bool
) -> tuple[float, float | None, float | None]:
    """Instructions per request of one gateway worker (``root``'s code) on ``kind``'s policy,
    and of them the handler's and the metrics snapshot's (compiled build only)."""
    policy = work / f"{kind}.yaml"
    policy.write_text(policy_text(kind, upstream))
    port, admin_port = free_port(), free_port()
    out = work / f"callgrind-{root.name}-{kind}.out"
    for stale in work.glob(f"{out.name}*"):  # a kept directory's earlier run
        stale.unlink()
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    argv += [sys.executable, "-m", "gateway", "run", "--config", str(policy), "--workers", "1"]
    argv += ["--listen", f"{HOST}:{port}", "--admin-listen", f"{HOST}:{admin_port}"]
    env = None
    if not tick:
        site = work / "hold-off-tick"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(HOLD_OFF_TICK)
        env = {**os.environ, "PYTHONPATH": str(site)}
    with running(argv, root, work / f"gateway-{root.name}-{kind}.log", env) as proc:
        wait_serving(port, proc, START_TIMEOUT_S)
        send(port, WARM_REQUESTS)
        # valgrind runs the program in its own process: the pid is the gateway's.
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        send(port, requests)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    dumps = sorted(work.glob(f"{out.name}.*"))  # the explicit dump is part 1
    for line in dumps[0].read_text().splitlines():
        if line.startswith("summary:"):
            return (int(line.split()[1]) / requests, *named_shares(dumps[0], requests))
    raise RuntimeError(f"no summary in {dumps[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--baseline-root", type=Path, help="another checkout, counted too")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"policies to count, of {','.join(KINDS + MORE_KINDS)}",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="a directory to keep callgrind's output in, for callgrind_annotate (by function)",
    )
    parser.add_argument(
        "--with-tick",
        action="store_true",
        help="leave the once-a-second observability tick on (its share moves with the load)",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    roots = [REPO_ROOT] + ([args.baseline_root.resolve()] if args.baseline_root else [])
    kinds = [kind for kind in args.kinds.split(",") if kind]
    unknown = set(kinds) - set(KINDS + MORE_KINDS)
    if unknown or not kinds:
        parser.error(f"--kinds takes some of {','.join(KINDS + MORE_KINDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            work = args.keep.resolve()
        upstream_port = free_port()
        upstream_argv = [sys.executable, str(BENCH_DIR / "upstream.py")]
        upstream_argv += ["--port", str(upstream_port)]
        with running(upstream_argv, REPO_ROOT, work / "upstream.log") as upstream:
            wait_serving(upstream_port, upstream, 30.0)
            upstream_url = f"http://{HOST}:{upstream_port}"
            rows = []
            for root in roots:
                counts = {}
                named = {}
                for kind in kinds:
                    total, handler, snapshot = count(
                        root, kind, upstream_url, args.requests, work, args.with_tick
                    )
                    counts[kind], named[kind] = total, (handler, snapshot)
                    print(f"bench: {root} {kind}: {total:,.0f} instructions/request")
                rows.append((root, counts, named))
    print(
        "\n| checkout | policy | instructions per request | over no limits "
        "| the handler's (inclusive) | over no limits | the metrics snapshot's |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for root, counts, named in rows:
        for kind in kinds:
            extra = counts[kind] - counts[NO_LIMITS] if NO_LIMITS in counts else 0.0
            handler, snapshot = named[kind]
            base = named[NO_LIMITS][0] if NO_LIMITS in named else None
            shown = ["-", "-", "-"]
            if handler is not None:
                shown[0] = f"{handler:,.0f}"
                if base is not None:
                    shown[1] = f"{handler - base:+,.0f}"
            if snapshot is not None:
                shown[2] = f"{snapshot:,.0f}"
            figures = f"{counts[kind]:,.0f} | {extra:+,.0f} | " + " | ".join(shown)
            print(f"| {root.name} | {kind} | {figures} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
