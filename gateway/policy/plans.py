"""A limit's plans and overrides resolved into tiers: each a copy of the limit with a plan's
numbers, checked as the limit itself is (the limit models call this when they load)."""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Any, Final, NamedTuple

from pydantic import ValidationError

# The values a ``plan:LIMIT`` key part takes besides a plan's name: a key that limit does not
# list (or a request without one), and a key listed with numbers of its own.
UNLISTED_PLAN: Final = "unlisted"
CUSTOM_PLAN: Final = "custom"


# What a plan or an override may set: the algorithm's numbers (and a calendar window's time
# zone: a customer's month is theirs), nothing about keys or matching.
OVERRIDE_PARAMS = frozenset(
    {"rate", "burst", "limit", "window", "nodelay", "delay", "warmup", "timezone"}
)
# What a plan's parameters are checked with but cannot change (a plan's warmup cannot ramp a
# limit charged after the response).
_VARIANT_CONTEXT = frozenset({"calendar", "count", "cost_header", "cost_from", "reserve"})


def variant_spec(spec: Any, params: dict[str, Any]) -> Any:
    """``spec`` with a plan's or an override's parameters (ValueError naming what is wrong)."""
    model = type(spec)
    unknown = sorted(set(params) - (OVERRIDE_PARAMS & set(model.model_fields)))
    if unknown:
        allowed = sorted(OVERRIDE_PARAMS & set(model.model_fields))
        raise ValueError(
            f"{', '.join(map(repr, unknown))} cannot be set for {spec.algorithm} "
            f"(expected {', '.join(allowed)})"
        )
    fields = {
        name: getattr(spec, name)
        for name in OVERRIDE_PARAMS | _VARIANT_CONTEXT
        if name in model.model_fields
    }
    if "hold" in spec.model_fields_set:  # checked with the limit's; the default otherwise
        fields["hold"] = spec.hold
    # The cost too, so that a model checking its numbers against it checks the variant's.
    if spec.reserve is None:  # reserve refuses a cost: the limit's own is 1 then
        fields["cost"] = spec.cost
    try:
        checked = model.model_validate({"algorithm": spec.algorithm, **fields, **params})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        reason = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {reason}" if where else reason) from None
    return spec.model_copy(update={name: getattr(checked, name) for name in params})


class OverrideError(ValueError):
    """A bad override: ``entry`` is its key value, so a loader can find its line."""

    def __init__(self, entry: str, reason: str) -> None:
        self.entry = entry
        super().__init__(f"override {entry!r}: {reason}")


class Tiers(NamedTuple):
    """Overrides resolved: each key value's tier, and each tier's spec. A tier's name stays
    the same across reloads: the plan's, or ``=`` and a digest of its numbers."""

    of_value: dict[str, str]
    specs: dict[str, Any]


def tier_specs(spec: Any, overrides: dict[str, Any]) -> Tiers:
    """``overrides`` resolved against the limit's plans; ValueError naming the first bad plan
    or override (``OverrideError`` for an override)."""
    plans: dict[str, Any] = {}
    for name, params in spec.plans.items():
        if name in (UNLISTED_PLAN, CUSTOM_PLAN):
            raise ValueError(
                f"plan {name!r}: the name is reserved (a plan: key part gives it to keys "
                f"{'not listed' if name == UNLISTED_PLAN else 'with numbers of their own'})"
            )
        try:
            plans[name] = variant_spec(spec, params)
        except ValueError as exc:
            raise ValueError(f"plan {name!r}: {exc}") from None
    specs: dict[str, Any] = {}
    of_value: dict[str, str] = {}
    by_params: dict[str, str] = {}
    networks = spec.key == ("client_ip",)
    for value, target in overrides.items():
        if target.__class__ is str:
            if target not in specs:
                plan = plans.get(target)
                if plan is None:
                    known = ", ".join(sorted(plans)) or "none defined"
                    raise OverrideError(value, f"unknown plan {target!r} (plans: {known})")
                specs[target] = plan
            of_value[value] = target
            continue
        if not isinstance(target, dict):
            raise OverrideError(value, "expected a plan's name or a mapping of parameters")
        signature = repr(sorted(target.items()))
        tier = by_params.get(signature)
        if tier is None:
            try:
                custom = variant_spec(spec, target)
            except ValueError as exc:
                raise OverrideError(value, str(exc)) from None
            tier = "=" + hashlib.blake2s(signature.encode(), digest_size=4).hexdigest()
            by_params[signature] = tier
            specs[tier] = custom
        of_value[value] = tier
    if networks:
        for value in of_value:
            if "/" in value:
                try:
                    ipaddress.ip_network(value, strict=False)
                except ValueError:
                    raise OverrideError(value, "invalid CIDR") from None
    return Tiers(of_value, specs)
