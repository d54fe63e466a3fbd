"""Per-limit overrides: how long a table of N overrides takes to load, and what a request pays
to find its tier, with a small table and a large one side by side (O(1): the same).

    python bench/bench_overrides.py --entries 100000 --repeats 5

Bounded: each figure is the median of ``--repeats`` runs; lookups run ``--lookups`` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.engine.limit_engine import LimitEngine
from gateway.engine.preflight import load_and_build
from gateway.stores import MemoryStore

POLICY = """server: {listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}
upstreams: {b: {url: 'http://127.0.0.1:9'}}
routes: [{name: all, upstream: b}]
limits:
  per_key:
    algorithm: token_bucket
    rate: 60r/m
    burst: 10
    key: ['header:X-API-Key']
    plans: {gold: {rate: 1000r/m}, silver: {rate: 100r/m}}
    overrides_file: FILE
"""


def _median_s(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _write(directory: Path, entries: int, form: str) -> Path:
    keys = {f"key-{i:07d}": ("gold", "silver")[i % 2] for i in range(entries)}
    name = f"tiers-{entries}.{form}"
    if form == "json":
        (directory / name).write_text(json.dumps(keys))
    else:
        (directory / name).write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
    policy = directory / f"policy-{entries}-{form}.yaml"
    policy.write_text(POLICY.replace("FILE", name))
    return policy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for form in ("yaml", "json"):
            policy = _write(directory, args.entries, form)

            def load(policy: Path = policy) -> LimitEngine:
                loaded = load_and_build(policy)  # validates, and builds the engine as check does
                return LimitEngine(loaded.policy, MemoryStore(FakeClock()), build_algorithm)

            seconds = _median_s(load, args.repeats)
            print(f"{args.entries} overrides ({form}): load_policy + engine {seconds:.3f} s")
        per_lookup = {}
        for entries in (100, args.entries):
            engine = LimitEngine(
                load_and_build(_write(directory, entries, "json")).policy,
                MemoryStore(FakeClock()),
                build_algorithm,
            )
            tiering = engine.limits[0].tiering
            assert tiering is not None and tiering.overrides is not None
            resolve = tiering.overrides.resolve
            probes = [f"key-{i % entries:07d}" for i in range(1000)]
            rounds = args.lookups // len(probes)

            def look(
                resolve: Callable[[str], object] = resolve,
                probes: list[str] = probes,
                rounds: int = rounds,
            ) -> None:
                for _ in range(rounds):
                    for probe in probes:
                        resolve(probe)

            per_lookup[entries] = _median_s(look, args.repeats) / (rounds * len(probes)) * 1e9
            print(f"lookup in {entries} overrides: {per_lookup[entries]:.0f} ns")
        small, large = per_lookup[100], per_lookup[args.entries]
        print(f"ratio {args.entries}/100 entries: {large / small:.2f}")


if __name__ == "__main__":
    main()
