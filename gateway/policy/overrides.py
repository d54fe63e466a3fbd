"""Per-limit tiers, costs and exemptions, compiled for the hot path.

An override gives one key value (or, for a ``client_ip`` key, a CIDR) its own parameters. Each
distinct parameter set becomes one variant of the limit: a ``CompiledLimit`` with the same name
and counters and its own algorithm and state table, so a request's check simply names the
variant and every store decides it as it decides any limit. Lookups are one dict probe for
exact values and one per distinct prefix length for CIDRs (longest prefix wins), whatever the
number of overrides.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Callable, Mapping
from typing import Any, Final, Generic, TypeVar

from gateway.policy.models import Cost, ReserveFrom, tier_specs

# A compiled limit (``gateway.limits.compiled.CompiledLimit``, which holds a ``Tiering``:
# generic here so that this module needs nothing from it).
L = TypeVar("L")

# The one key of every unlisted key of a limit with ``unlisted: shared``: tagged as the key
# builder tags its own stand-ins (``limits.keys.TAG``), so no value a client sends is it.
UNLISTED_KEY: Final = "\x1eunlisted"


class UnlistedKey(Exception):
    """A key the limit's overrides do not list, under ``unlisted: reject``; ``limit`` is the
    compiled limit that refused it (set by whoever knows it)."""

    def __init__(self, limit: Any = None) -> None:
        super().__init__()
        self.limit = limit


class Overrides(Generic[L]):
    """Key value -> the variant of a limit that decides it; ``None`` when the key has none."""

    __slots__ = ("_exact", "_v4", "_v6", "variants")

    def __init__(
        self, limit: Any, build_algorithm: Callable[[Any], Any], entries: Mapping[str, Any]
    ) -> None:
        tiers = tier_specs(limit.spec, dict(entries))
        # One variant per tier, its table named by the tier so that a reload keeps (or
        # rescales) its keys.
        variants: dict[str, L] = {
            tier: dataclasses.replace(
                limit,
                spec=spec,
                algorithm=build_algorithm(spec),
                window_s=spec.window_s,
                table=f"{limit.name}~{tier}",
            )
            for tier, spec in tiers.specs.items()
        }
        of_value = tiers.of_value
        prefixes: dict[int, dict[int, dict[int, L]]] = {4: {}, 6: {}}
        if limit.spec.key == ("client_ip",) and any("/" in value for value in of_value):
            self._exact: dict[str, L] = {}
            for value, tier in of_value.items():
                if "/" not in value:
                    self._exact[value] = variants[tier]
                    continue
                network = ipaddress.ip_network(value, strict=False)
                by_length = prefixes[network.version].setdefault(network.prefixlen, {})
                by_length[int(network.network_address)] = variants[tier]
        else:
            self._exact = {value: variants[tier] for value, tier in of_value.items()}
        self.variants: tuple[L, ...] = tuple(variants.values())
        self._v4: tuple[tuple[int, dict[int, L]], ...] = _longest_first(prefixes[4])
        self._v6: tuple[tuple[int, dict[int, L]], ...] = _longest_first(prefixes[6])

    def __len__(self) -> int:
        return len(self._exact) + sum(len(t) for _, t in self._v4 + self._v6)

    def resolve(self, key: str) -> L | None:
        variant = self._exact.get(key)
        if variant is not None or not (self._v4 or self._v6):
            return variant
        # An IPv6 client key is its network, 'addr/prefix': its address part is looked up.
        try:
            address = ipaddress.ip_address(key.partition("/")[0])
        except ValueError:
            return None
        table, bits = (self._v4, 32) if address.version == 4 else (self._v6, 128)
        number = int(address)
        for length, networks in table:
            variant = networks.get(number >> (bits - length) << (bits - length))
            if variant is not None:
                return variant
        return None


def _longest_first(tables: dict[int, dict[int, L]]) -> tuple[tuple[int, dict[int, L]], ...]:
    return tuple(sorted(tables.items(), reverse=True))


class Exemptions:
    """Who bypasses one limit: client CIDRs, or a header holding one of the configured values
    (compared in constant time; the values never leave this object)."""

    __slots__ = ("_headers", "_networks")

    def __init__(self, cidrs: tuple[str, ...], headers: Mapping[str, tuple[str, ...]]) -> None:
        self._networks = tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)
        self._headers = tuple(
            (name, tuple(v.encode() for v in values)) for name, values in headers.items()
        )

    def __repr__(self) -> str:
        return f"Exemptions({len(self._networks)} networks, {len(self._headers)} headers)"

    def exempt(self, client_ip: str, headers: Mapping[str, str]) -> bool:
        if self._networks:
            try:
                address = ipaddress.ip_address(client_ip.partition("/")[0])
            except ValueError:
                address = None
            if address is not None and any(address in n for n in self._networks):
                return True
        for name, secrets in self._headers:
            sent = headers.get(name)
            if sent is None:
                continue
            given = sent.encode("utf-8", "surrogateescape")
            # Every value compared, so the time taken tells nothing about which one matched.
            matched = False
            for secret in secrets:
                matched |= hmac.compare_digest(given, secret)
            if matched:
                return True
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class Tiering:
    """What a limit needs beyond its own parameters on each request: exemptions, cost, tiers.
    ``None`` on a limit that uses none of them, so such limits pay one attribute test."""

    exemptions: Exemptions | None
    cost: int | Cost | ReserveFrom
    overrides: Overrides[Any] | None
    # ``unlisted:``: keys the overrides do not list share one bucket, or are refused.
    share_unlisted: bool = False
    reject_unlisted: bool = False
    # ``exempt_listed:``: whether another limit's overrides list this request's key.
    listed_elsewhere: Callable[[Any], bool] | None = None
    # ``plan_from:``: the plan the request names (a claim of its token); ``overrides`` then
    # maps each plan's name to its variant.
    plan_from: Callable[[Any], str | None] | None = None

    def resolve(self, limit: L, key: str, facts: Any) -> tuple[L, str, int] | None:
        """The variant of ``limit`` that decides this request, the key it decides it under and
        its cost; ``None`` when the request is exempt from the limit. Raises ``UnlistedKey``
        for a key the overrides do not list under ``unlisted: reject``."""
        exemptions = self.exemptions
        if exemptions is not None and exemptions.exempt(facts.client_key, facts.headers):
            return None
        listed_elsewhere = self.listed_elsewhere
        if listed_elsewhere is not None and listed_elsewhere(facts):
            return None
        overrides = self.overrides
        plan_from = self.plan_from
        if plan_from is not None:
            plan = plan_from(facts)
            variant = (
                overrides.resolve(plan) if plan is not None and overrides is not None else None
            )
            if variant is not None:
                limit = variant
        elif overrides is not None:
            variant = overrides.resolve(key)
            if variant is not None:
                limit = variant
            elif self.share_unlisted:
                key = UNLISTED_KEY
            elif self.reject_unlisted:
                raise UnlistedKey
        cost = self.cost
        if isinstance(cost, int):
            return limit, key, cost
        if isinstance(cost, Cost):
            return limit, key, cost.of(facts.route, facts.method)
        return limit, key, cost.of_body(facts.body)  # a reservation read from the body


def compile_tiering(
    limit: Any,
    build_algorithm: Callable[[Any], Any],
    listed_elsewhere: Callable[[Any], bool] | None = None,
    plan_from: Callable[[Any], str | None] | None = None,
) -> Tiering | None:
    spec = limit.spec
    entries: dict[str, Any] = dict(spec.overrides)
    if plan_from is not None:
        # Each plan is a variant, found by its own name (the validation keeps overrides out).
        entries = {plan: plan for plan in spec.plans}
    if not (
        spec.exempt
        or spec.exempt_headers
        or entries
        or spec.cost != 1
        or spec.reserve is not None
        or spec.unlisted != "own"
        or listed_elsewhere is not None
        or plan_from is not None
    ):
        return None
    exemptions = (
        Exemptions(spec.exempt, spec.exempt_headers)
        if (spec.exempt or spec.exempt_headers)
        else None
    )
    overrides: Overrides[Any] | None = (
        Overrides(limit, build_algorithm, entries) if entries else None
    )
    if overrides is None and spec.unlisted != "own":
        # An overrides_file that lists nobody (yet): every key is unlisted.
        overrides = Overrides(limit, build_algorithm, {})
    return Tiering(
        exemptions,
        # What a request takes at admission: a limit charged after the response that reserves
        # an estimate holds that (settled to the response's cost).
        spec.reserve if spec.reserve is not None else spec.cost,
        overrides,
        share_unlisted=spec.unlisted == "shared",
        reject_unlisted=spec.unlisted == "reject",
        listed_elsewhere=listed_elsewhere,
        plan_from=plan_from,
    )
