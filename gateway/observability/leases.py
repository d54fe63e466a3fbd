"""What a leased limit's leases did (``lease:`` on the Redis store, ``store.worker_lease`` on the
shared store), for the metrics and the dashboard: read from the store when it leases, summed
over workers, exported per limit."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict

from gateway.stores.protocol import LeasingStore


class LeaseData(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    granted: int = 0  # leases granted
    units_granted: int = 0
    returned: int = 0  # leases given back with units unused
    units_returned: int = 0
    expired: int = 0  # leases that ran out of time with units unused
    last_size: int = 0  # gauge: units of the latest grant (the largest over workers)
    calls: int = 0  # Redis calls for leases
    decided: int = 0  # requests decided from a lease

    def plus(self, other: LeaseData | None) -> LeaseData:
        if other is None:
            return self
        fields = LeaseData.model_fields
        summed = {name: getattr(self, name) + getattr(other, name) for name in fields}
        summed["last_size"] = max(self.last_size, other.last_size)
        return LeaseData(**summed)


def lease_data(store: object, limit_name: str) -> LeaseData | None:
    """A limit's lease figures, or None when the store does not lease it."""
    if not isinstance(store, LeasingStore):
        return None
    figures = store.lease_counters(limit_name)
    if figures is None:
        return None
    return LeaseData(**{name: getattr(figures, name) for name in LeaseData.model_fields})


def plus(first: LeaseData | None, second: LeaseData | None) -> LeaseData | None:
    if first is None:
        return second
    return first.plus(second)


def lease_metrics(limits: Iterable[tuple[str, LeaseData | None]]) -> Iterator[Metric]:
    """Per leased limit: leases by event, units by event, the latest lease's size, Redis
    calls for leases, requests decided from a lease."""
    leases = CounterMetricFamily(
        "gateway_limit_leases",
        "Quota leases of a limit, by event: granted, returned (unused units given back), "
        "expired (time ran out with units unused).",
        labels=["limit", "event"],
    )
    units = CounterMetricFamily(
        "gateway_limit_lease_units",
        "Units of a limit's quota leased (granted) and given back (returned).",
        labels=["limit", "event"],
    )
    size = GaugeMetricFamily(
        "gateway_limit_lease_size", "Units of a limit's latest lease.", labels=["limit"]
    )
    calls = CounterMetricFamily(
        "gateway_limit_lease_store_calls",
        "Redis calls made for a limit's leases (grants and returns).",
        labels=["limit"],
    )
    decided = CounterMetricFamily(
        "gateway_limit_lease_decisions",
        "Requests a limit decided from a lease, without a Redis call.",
        labels=["limit"],
    )
    for name, data in limits:
        if data is None:
            continue
        leases.add_metric([name, "granted"], data.granted)
        leases.add_metric([name, "returned"], data.returned)
        leases.add_metric([name, "expired"], data.expired)
        units.add_metric([name, "granted"], data.units_granted)
        units.add_metric([name, "returned"], data.units_returned)
        size.add_metric([name], data.last_size)
        calls.add_metric([name], data.calls)
        decided.add_metric([name], data.decided)
    yield from (leases, units, size, calls, decided)
