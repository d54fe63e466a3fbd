"""A real Prometheus (Debian's ``prometheus``) scraping a running gateway: the Grafana dashboard's
rejection-ratio query returns the ratio the test's traffic implies, and every query of the
dashboard parses and names only metrics the gateway exports. The shipped Prometheus config and
the compose file are checked statically (promtool; no Docker engine here).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.clock import FakeClock
from tests.support.gateways import GatewayFactory
from tests.support.network import TIMEOUT, free_port, get_status
from tests.support.policies import limited_policy
from tests.support.processes import LoggedProcess
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_for_status

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose"
GRAFANA = ROOT / "contrib" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gateway.json"
ALERTS = ROOT / "contrib" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "contrib" / "prometheus" / "alerts_test.yml"
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
RATE_INTERVAL = "1m"  # what the test puts for Grafana's $__rate_interval


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panel_queries() -> Iterator[tuple[str, str]]:
    """(panel title, expr) for every query in the dashboard."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def variable_queries() -> list[str]:
    return [v["query"]["query"] for v in dashboard()["templating"]["list"] if v["type"] == "query"]


def substitute(expr: str) -> str:
    """Grafana's variables as the dashboard's defaults expand them (All = ``.*``)."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$limit", ".*")
        .replace("$route", ".*")
        .replace("$upstream", ".*")
    )


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:gateway|process)_[a-z0-9_]+)\b", expr))


def alert_exprs() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule in the shipped alert rules."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def rejection_ratio_query() -> str:
    titles = {title: expr for title, expr in panel_queries()}
    return titles["Rejection ratio per limit"]


# -- the real Prometheus -------------------------------------------------------------------------


class Prometheus:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with self.session.get(self.url + "/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def scalar(self, expr: str) -> float | None:
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else None

    async def wait_for(self, expr: str, expected: float, within_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        seen = None
        while loop.time() < deadline:
            seen = await self.scalar(expr)
            if seen == expected:
                return
            await asyncio.sleep(0.25)
        raise AssertionError(f"{expr} was {seen}, not {expected}, after {within_s}s")

    async def metric_names(self) -> set[str]:
        async with self.session.get(self.url + "/api/v1/label/__name__/values") as resp:
            body = await resp.json()
        return set(body["data"])


async def start_prometheus(
    tmp_path: Path, target: str
) -> tuple[asyncio.subprocess.Process, str, Path]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "gateway", "static_configs": [{"targets": [target]}]}
                ],
            }
        )
    )
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    return proc, f"http://127.0.0.1:{port}", log_path


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client:
        yield client


async def test_dashboard_rejection_ratio_query_returns_what_the_traffic_implies(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    limits = (
        "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 9\n    nodelay: true\n"
        "  shadow:\n    algorithm: fixed_window\n    limit: 20\n    window: 1h\n    dry_run: true\n"
        # never binding: here so that the panels' and alerts' metrics of concurrency limits
        # and adaptive upstreams exist (a request another limit refuses is charged nothing)
        "  in_flight:\n    algorithm: concurrency\n    limit: 1000\n"
        # and of limits counted by their responses (units held by requests in flight)
        "  metered:\n    algorithm: fixed_window\n    limit: 1000000\n    window: 1h\n"
        "    count: {statuses: [5xx]}\n"
    )
    policy = limited_policy(upstream.url, limits).replace(
        "    read_timeout: 5s\n", "    read_timeout: 5s\n    adaptive: {}\n"
    )
    gw = await start_gateway(policy, clock=clock)
    proc, url, log_path = await start_prometheus(tmp_path, f"127.0.0.1:{gw.gateway.admin_port}")
    prometheus = Prometheus(url, session)
    try:
        # Scraped, with a sample from before any traffic (the ratio's window starts at zero).
        await wait_for_status(LoggedProcess(proc, log_path), url + "/-/ready", within_s=30.0)
        await prometheus.wait_for('count_over_time(up{job="gateway"}[1m]) >= bool 2', 1.0)
        await prometheus.wait_for('max(up{job="gateway"})', 1.0)

        # Clock frozen, rate 1r/m, burst 9: 10 of 40 admitted, 30 rejected (ratio 0.75). The
        # dry-run limit allows 20 per hour: it would have rejected 20 of 40 (ratio 0.5).
        statuses = [await get_status(session, gw.url + f"/{i}") for i in range(40)]
        assert statuses.count(200) == 10 and statuses.count(429) == 30
        for limit in ("per_ip", "shadow"):
            await prometheus.wait_for(
                f'sum(gateway_limit_decisions_total{{limit="{limit}"}})', 40.0
            )

        result = await prometheus.query(substitute(rejection_ratio_query()))
        ratios = {series["metric"]["limit"]: float(series["value"][1]) for series in result}
        assert ratios == {
            "per_ip": pytest.approx(0.75),
            "shadow": pytest.approx(0.5),
            "in_flight": 0.0,
            "metered": 0.0,
        }

        # Every query of the dashboard parses and names only metrics the gateway exports.
        exported = await prometheus.metric_names()
        for title, expr in panel_queries():
            await prometheus.query(substitute(expr))
            missing = {m for m in metric_names(expr) - exported if not m.startswith("gateway_tls_")}
            assert not missing, (title, missing)
        for query in variable_queries():
            assert metric_names(query) <= exported, query
        # so does every shipped alert rule (the TLS listener's metrics exist with server.tls:
        # tests/test_listener_tls.py reads them)
        for alert, expr in alert_exprs():
            await prometheus.query(expr)
            missing = {m for m in metric_names(expr) - exported if not m.startswith("gateway_tls_")}
            assert not missing, (alert, missing)
        # the limit's rejections are told from other answers by their exact code
        rejected = 'sum(gateway_local_responses_total{code="429"})'
        await prometheus.wait_for(rejected, 30.0)
        # and the panels that the traffic concerns show it
        decisions = next(e for t, e in panel_queries() if t == "Decisions per second")
        assert await prometheus.query(substitute(decisions))
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


# -- shipped files, checked statically -------------------------------------------------------------


def test_shipped_prometheus_config_is_valid_and_scrapes_the_compose_gateway() -> None:
    config = GRAFANA / "prometheus" / "prometheus.yml"
    checked = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    targets = yaml.safe_load(config.read_text())["scrape_configs"][0]["static_configs"][0]
    base = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    host, port = targets["targets"][0].split(":")
    assert host in base
    assert any(mapping.endswith(f":{port}") for mapping in base[host]["ports"])


def test_alert_rules_are_valid_and_fire_on_what_they_watch() -> None:
    """``promtool check rules``, then ``promtool test rules``: each alert fires on the series
    that should raise it (and not before its ``for``), and stays quiet on the others."""
    for command in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERTS_TEST)]):
        checked = subprocess.run(
            [PROMTOOL, *command], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert {name for name, _ in alert_exprs()} >= {
        "GatewayHighRejectionRatio",
        "GatewayStoreDegraded",
        "GatewayPolicyReloadFailed",
        "GatewayUpstreamErrors",
        "GatewayAdaptiveLimitShedding",
    }


def test_compose_profile_wires_prometheus_and_grafana_to_shipped_files() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.observability.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}
    for service in services.values():
        assert service["profiles"] == ["observability"]
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            assert (COMPOSE / source).exists(), source
    datasource = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    # Grafana reaches Prometheus by its compose service name, on its container port.
    assert datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "gateway.yml").read_text()
    )["providers"][0]
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert grafana_mounts["../../contrib/grafana/dashboards"] == provider["options"]["path"]


def test_dashboard_json_covers_what_operators_watch() -> None:
    data = dashboard()
    assert data["uid"] and data["panels"]
    exprs = " ".join(expr for _, expr in panel_queries())
    for metric in (
        "gateway_limit_decisions_total",
        "gateway_limit_queue_wait_seconds_bucket",
        "gateway_upstream_errors_total",
        "gateway_store_state",
        "gateway_limit_slots_in_use",
        "gateway_adaptive_limit",
        "gateway_adaptive_latency_seconds",
        "gateway_limit_charged_units_total",
        "gateway_limit_held_units_total",
        "gateway_limit_returned_units_total",
        "gateway_limit_units_in_flight",
    ):
        assert metric in exprs, metric
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
