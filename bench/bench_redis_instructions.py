"""Instructions Redis spends per three-limit decision, counted by valgrind (callgrind): the
figure for "does the decision script do less", which the load of a shared machine does not
move (commandstats' µs and CPU time wander by 10-30 % there).

    python bench/bench_redis_instructions.py --decides 2000
    python bench/bench_redis_instructions.py --decides 2000 --baseline-root ../before

A ``redis-server`` runs under callgrind; for each ``--callers`` count (1 and 64 by default) a
client process (``bench_store_decide.py``'s three example limits, ``store.decide`` by
``FCALL``) warms up, zeroes the counters, makes ``--decides`` decisions and dumps the count.
Printed per decision: Redis's instructions in user space in all (reading, parsing, answering
each pipeline included, but not the kernel's side of its reads and writes, which CPU time
counts) and in ``fcallCommand`` (the script, what commandstats times). ``--baseline-root``
counts another checkout's script the same way, rounds alternating. Needs valgrind; the
redis-server binary's own symbols are not needed (``fcallCommand`` is an exported name).
Instructions are not time (a cache miss counts as one), but the script's work is mostly
instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
SCRIPT_FUNCTION = "fcallCommand"
WARM_DECIDES = 200
START_TIMEOUT_S = 60.0  # redis-server starts slowly under valgrind


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server under valgrind exited ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"redis-server did not listen on {port} in {START_TIMEOUT_S:.0f} s")


def callgrind_control(action: str, pid: int) -> None:
    # valgrind runs the program in its own process: the pid is redis-server's.
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)


async def client(url: str, decides: int, callers: int, redis_pid: int) -> None:
    """The decisions, from the checkout first on ``sys.path``: warm, zero, count, dump."""
    from bench_store_decide import example_limits

    from gateway.limits.compiled import Check
    from gateway.stores import RedisStore

    limits = example_limits(False)
    store = RedisStore(url, key_prefix=f"instructions:{time.time()}:", timeout_s=30.0)
    store.configure(limits, ())
    checks = [Check(limits[0], "203.0.113.7"), Check(limits[1], "203.0.113.7")]
    checks.append(Check(limits[2], ""))

    async def caller(count: int) -> None:
        for _ in range(count):
            if not (await store.decide(checks)).allowed:
                raise RuntimeError("a decision was a rejection: the limits are set never to bind")

    try:
        await asyncio.gather(*(caller(WARM_DECIDES // callers + 1) for _ in range(callers)))
        await asyncio.to_thread(callgrind_control, "-z", redis_pid)  # zero the counts
        await asyncio.gather(*(caller(decides // callers) for _ in range(callers)))
        await asyncio.to_thread(callgrind_control, "-d", redis_pid)  # dump them
    finally:
        await store.close()


def counted(dump: Path, decides: int) -> tuple[float, float]:
    """Instructions per decision in all and in the script (fcallCommand, inclusive)."""
    total = script = 0
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            total = int(line.split()[1])
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in annotated.splitlines():
        if f":{SCRIPT_FUNCTION} [" in line:  # "1,234 (5.0%)  ???:fcallCommand [binary]"
            script = int(line.split()[0].replace(",", ""))
            break
    return total / decides, script / decides


def measure(root: Path, port: int, pid: int, decides: int, callers: int) -> None:
    """One client run from ``root``'s checkout (its gateway, its script)."""
    code = (
        "import asyncio, sys; "
        f"sys.path[:0] = [{str(root)!r}, {str(root / 'bench')!r}, {str(BENCH_DIR)!r}]; "
        "import bench_redis_instructions as b; "
        f"asyncio.run(b.client('redis://127.0.0.1:{port}', {decides}, {callers}, {pid}))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decides", type=int, default=2000, help="decisions counted per run")
    parser.add_argument("--callers", default="1,64", help="comma-separated callers in flight")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline-root", type=Path, help="another checkout, counted alike")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "redis-server"):
        if shutil.which(tool) is None:
            print(f"bench_redis_instructions.py: {tool} not found", file=sys.stderr)
            return 2
    roots = {"this": REPO_ROOT}
    if args.baseline_root is not None:
        roots = {"base": args.baseline_root.resolve(), **roots}
    callers = [int(count) for count in args.callers.split(",")]
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-redis-ir-") as tmp:
        work = Path(tmp)
        port = free_port()
        out = work / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        argv += ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", tmp]
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_listening(port, server)
            for _ in range(args.rounds):
                for name, root in roots.items():
                    for count in callers:
                        before = set(work.glob("callgrind.out.*"))
                        measure(root, port, server.pid, args.decides, count)
                        (dump,) = set(work.glob("callgrind.out.*")) - before
                        made = args.decides // count * count
                        figures.setdefault((name, count), []).append(counted(dump, made))
        finally:
            server.terminate()
            server.wait(30)
    print("| checkout | callers | Redis instructions / decide | of them in the script |")
    print("|---|---:|---:|---:|")
    for (name, count), runs in figures.items():
        total = statistics.median(run[0] for run in runs)
        script = statistics.median(run[1] for run in runs)
        print(f"| {name} | {count} | {total:,.0f} | {script:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
