"""A JWT claim as a limit's key against a header as the key: what one request's verdict costs
in the engine (facts made, key built, decided in process), tokens seen before (the verified
token cache), against the same requests keyed by an API-key header.

    python bench/bench_jwt_key.py --tokens 1000 --requests 200000 --repeats 5

Bounded: each figure is the fastest of ``--repeats`` runs of ``--requests`` verdicts, the
two keys' runs interleaved; CPU time of this process (the machine's other load left out).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from joserfc import jwt
from joserfc.jwk import OctKey
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.algorithms.registry import build_algorithm
from gateway.clock import MonotonicClock
from gateway.engine.limit_engine import LimitEngine
from gateway.engine.preflight import load_and_build
from gateway.limits.keys import RequestFacts
from gateway.policy.models import Route
from gateway.stores import MemoryStore

SECRET = b"a-benchmark-secret-of-at-least-32-bytes"
POLICY = """server: {listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}
upstreams: {b: {url: 'http://127.0.0.1:9'}}
routes: [{name: all, upstream: b}]
limits:
  per_key:
    algorithm: fixed_window
    limit: 1000000000
    window: 1h
    key: [KEY]
"""


def _engine(directory: Path, key: str) -> LimitEngine:
    text = POLICY.replace("KEY", key)
    if "jwt:" in key:
        (directory / "secret").write_bytes(SECRET)
        text += f"jwt: {{secret_file: {directory / 'secret'}}}\n"
    policy = directory / "policy.yaml"
    policy.write_text(text)
    loaded = load_and_build(policy)
    return LimitEngine(loaded.policy, MemoryStore(MonotonicClock()), build_algorithm)


def _run(engine: LimitEngine, headers: list[CIMultiDictProxy[str]], requests: int) -> float:
    route = Route(name="all", upstream="b")
    count = len(headers)
    started = time.process_time()
    for i in range(requests):
        facts = RequestFacts.of("10.0.0.1", 64, "all", "GET", headers[i % count], dict)
        engine.evaluate_now(facts, route, "h", "/", "10.0.0.1")
    return (time.process_time() - started) / requests


def _build_keys(engine: LimitEngine, headers: list[CIMultiDictProxy[str]], requests: int) -> float:
    """The key alone: a request's facts made and its limit's key built."""
    keys = engine.limits[0].keys
    count = len(headers)
    started = time.process_time()
    for i in range(requests):
        keys.build(RequestFacts.of("10.0.0.1", 64, "all", "GET", headers[i % count], dict))
    return (time.process_time() - started) / requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    key = OctKey.import_key(SECRET)
    exp = int(time.time()) + 86_400
    tokens = [
        jwt.encode({"alg": "HS256"}, {"sub": f"u{i}", "exp": exp}, key) for i in range(args.tokens)
    ]
    by_token = [CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {t}"})) for t in tokens]
    by_header = [
        CIMultiDictProxy(CIMultiDict({"X-Api-Key": f"key-{i:08d}"})) for i in range(args.tokens)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        header_engine = _engine(Path(tmp), "'header:X-Api-Key'")
        jwt_engine = _engine(Path(tmp), "'jwt:sub'")
        _run(jwt_engine, by_token, args.tokens)  # every token seen once: the cache warm
        # Interleaved, the fastest of each: the machine's other load touches both alike.
        header_runs, jwt_runs = [], []
        for _ in range(args.repeats):
            header_runs.append(_run(header_engine, by_header, args.requests))
            jwt_runs.append(_run(jwt_engine, by_token, args.requests))
        header_us, jwt_us = min(header_runs), min(jwt_runs)
        header_key_us = min(
            _build_keys(header_engine, by_header, args.requests) for _ in range(args.repeats)
        )
        jwt_key_us = min(
            _build_keys(jwt_engine, by_token, args.requests) for _ in range(args.repeats)
        )
    print(f"header key: {header_us * 1e6:.2f} µs per verdict ({header_key_us * 1e6:.2f} the key)")
    print(
        f"jwt:sub key (tokens seen before): {jwt_us * 1e6:.2f} µs per verdict "
        f"({jwt_key_us * 1e6:.2f} the key)"
    )
    print(f"jwt over header: {(jwt_us / header_us - 1) * 100:+.1f} % per verdict")


if __name__ == "__main__":
    main()
