"""Reading ``/metrics``: every sample of a scrape, one sample by name and labels, and a scrape
repeated until it shows what a test waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def scrape(session: aiohttp.ClientSession, admin_url: str) -> tuple[Samples, str]:
    async with session.get(admin_url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return parse_metrics(text), text


async def scrape_until(
    session: aiohttp.ClientSession,
    admin_url: str,
    condition: Callable[[Samples], bool],
    within_s: float = 10.0,
) -> Samples:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    samples: Samples = {}
    while loop.time() < deadline:
        try:
            samples, _ = await scrape(session, admin_url)
        except (aiohttp.ClientError, AssertionError):
            samples = {}
        if samples and condition(samples):
            return samples
        await asyncio.sleep(0.2)
    raise AssertionError(f"no scrape met the condition within {within_s}s: {samples}")
