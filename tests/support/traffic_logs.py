"""Access logs of known populations, for ``gateway suggest``: well-behaved clients (a request
every few seconds to a minute, now and then a small burst) and a few abusive ones (a steady
flood), written in nginx ``combined`` or as the gateway's JSON lines. Deterministic: a seed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

START = 1_700_000_000  # 2023-11-14T22:13:20Z
PATHS = ("/api/items", "/api/orders", "/static/app.js", "/login")


@dataclass(frozen=True)
class Population:
    normal: list[str]
    abusive: list[str]
    requests: int


def _events(
    normal: int, abusive: int, span_s: int, seed: int, flood_per_s: float
) -> tuple[list[tuple[float, str, str, str]], Population]:
    rng = random.Random(seed)
    events: list[tuple[float, str, str, str]] = []
    normal_ips = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(normal)]
    abusive_ips = [f"203.0.113.{i + 1}" for i in range(abusive)]
    for index, ip in enumerate(normal_ips):
        key = f"key-normal-{index}"
        t = rng.uniform(0, 30)
        mean_gap = rng.uniform(5, 60)
        while t < span_s:
            burst = 3 if rng.random() < 0.05 else 1
            for i in range(burst):
                events.append((t + i * 0.2, ip, rng.choice(PATHS), key))
            t += rng.expovariate(1 / mean_gap)
    for index, ip in enumerate(abusive_ips):
        key = f"key-abusive-{index}"
        t = rng.uniform(0, 5)
        while t < span_s:
            events.append((t, ip, "/api/items", key))
            t += rng.expovariate(flood_per_s)
    events.sort()
    return events, Population(normal_ips, abusive_ips, len(events))


def combined_log(
    path: Path, normal: int = 200, abusive: int = 3, span_s: int = 1800, seed: int = 1,
    flood_per_s: float = 5.0,
) -> Population:  # fmt: skip
    """One line per request in nginx ``combined``, with ``$msec`` after the user agent (the
    instant to the millisecond, as replay reads it)."""
    events, population = _events(normal, abusive, span_s, seed, flood_per_s)
    with path.open("w", encoding="ascii") as out:
        for t, ip, target, _ in events:
            stamp = datetime.fromtimestamp(START + int(t), UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
            out.write(
                f'{ip} - - [{stamp}] "GET {target} HTTP/1.1" 200 12 "-" "client/1.0" '
                f"{START + t:.3f}\n"
            )
    return population


def json_lines_log(
    path: Path, normal: int = 200, abusive: int = 3, span_s: int = 1800, seed: int = 1
) -> Population:
    """JSON lines with headers: each client sends its API key in ``X-Api-Key``."""
    events, population = _events(normal, abusive, span_s, seed, 5.0)
    with path.open("w", encoding="ascii") as out:
        for t, ip, target, key in events:
            record = {
                "ts": round(START + t, 3),
                "ip": ip,
                "method": "GET",
                "path": target,
                "headers": {"X-Api-Key": key},
            }
            out.write(json.dumps(record) + "\n")
    return population


def gateway_log(
    path: Path, normal: int = 200, abusive: int = 3, span_s: int = 1800, seed: int = 1
) -> Population:
    """The gateway's own JSON access log: ``t_us`` the limiter's instant (monotonic, from
    some start), ``ts`` calendar time."""
    events, population = _events(normal, abusive, span_s, seed, 5.0)
    with path.open("w", encoding="ascii") as out:
        for t, ip, target, _ in events:
            record = {
                "ts": round(START + t, 6),
                "t_us": 5_000_000 + round(t * 1_000_000),
                "client": ip,
                "method": "GET",
                "host": "a",
                "path": target,
                "route": "all",
                "limit": "allowed",
                "limit_name": None,
                "delay_ms": 0.0,
                "status": 200,
            }
            out.write(json.dumps(record) + "\n")
    return population


def combined_line(ip: str, second: int, path: str = "/") -> str:
    """One nginx ``combined`` line at ``START + second``, whole seconds as nginx writes it."""
    stamp = datetime.fromtimestamp(START + second, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
    return f'{ip} - - [{stamp}] "GET {path} HTTP/1.1" 200 12 "-" "curl/8.5"\n'
