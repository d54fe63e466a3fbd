"""``limits:``: a limit's settings, one model per algorithm in the ``Limit`` union, and the
policy-wide ``headers:`` (what rate-limit headers responses carry) and ``access:`` (clients
past every limit, or denied)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from gateway.policy.cost_from import parse_cost_from
from gateway.policy.identity import PlanFrom
from gateway.policy.limit_fields import (
    Cost,
    LeaseSettings,
    LimitMatch,
    RateField,
    ReserveFrom,
    ResponseCount,
    WindowLength,
)
from gateway.policy.model_base import (
    _HEADER_NAME_RE,
    Duration,
    LimitLogLevel,
    Name,
    _Model,
    check_key_parts,
)
from gateway.policy.penalty import Penalty
from gateway.policy.plans import tier_specs
from gateway.policy.rejections import RejectionResponse
from gateway.policy.units import time_zone

# Why an algorithm cannot be leased: a grant is a batch of whole admissions taken ahead.
_NOT_LEASABLE = {
    "leaky_bucket": "a leaky_bucket that delays cannot be leased: its delays are computed per "
    "request from the shared state (nginx-exact), a batch taken ahead cannot shape them; lease "
    "one with nodelay: true",
    "sliding_log": "sliding_log cannot be leased: it is exact per request timestamp, a batch "
    "taken ahead has none",
    "concurrency": "concurrency cannot be leased: a slot is given back when its request ends, "
    "and a batch of slots taken ahead would be held by nobody",
}


# Headers that frame the message or the connection: never a cost header, since removing one
# would break the response.
_FRAMING_HEADERS = frozenset(
    {"connection", "content-length", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
)


class _LimitBase(_Model):
    lease: LeaseSettings | None = Field(
        None,
        description="take batches of this limit from the Redis store and decide locally "
        "(fixed_window, sliding_window, token_bucket in reject mode, leaky_bucket with nodelay); "
        "{} for the defaults",
    )
    key: tuple[str, ...] = Field(
        ("client_ip",),
        description="parts joined into the key: client_ip, header:NAME, query:NAME, route, "
        "method, global, const:TEXT, plan:LIMIT (the plan another limit's overrides give the "
        "request's key: a plan's name, custom, or unlisted), jwt:CLAIM (a claim of the "
        "request's verified token, see jwt)",
    )
    on_missing_key: Literal["skip", "client_ip"] = Field(
        "skip",
        description="when a header/query key part is absent: skip the limit, or use "
        "the client IP in its place",
    )
    match: LimitMatch = Field(LimitMatch(), description="omitted: every request")
    dry_run: bool = Field(False, description="count would-delay/would-reject, never enforce")
    status: int = Field(429, ge=400, le=599, description="status for rejected requests")
    rejection: RejectionResponse | None = Field(
        None,
        description="how this limit's rejections are answered (status, content type, body "
        "template); default: the policy's rejection, else problem+json",
    )
    penalty: Penalty | None = Field(
        None,
        description="a key rejected that often is refused at once for a while: {after: 10, "
        "within: 1m, block: 15m, status: 429 or 403}",
    )
    max_delay: Duration = Field(
        30.0, description="a request that would wait longer is rejected at once"
    )
    max_queue: int = Field(1000, ge=0, description="requests waiting on this limit at most")
    max_keys: int = Field(100_000, ge=1, description="tracked keys; least recently used evicted")
    log_level: LimitLogLevel | None = Field(
        None,
        description="level of this limit's rejection lines (delays one lower), or off; "
        "default: server.limit_log_level",
    )
    top_keys: Literal["hashed", "plain"] = Field(
        "hashed",
        description="how the dashboard's top limited keys show header: and query: key parts "
        "(often API keys): hashed (sha256, 12 hex digits) or plain",
    )

    cost: int | Cost = Field(
        1,
        description="units one request takes from the quota: a number, or a default with "
        "per-route and per-method costs",
    )
    count: ResponseCount | None = Field(
        None,
        description="charge only responses with these statuses, after the response: a request "
        "is admitted while the key has room, and holds its cost while in flight (see hold)",
    )
    cost_header: str | None = Field(
        None,
        description="response header in which the upstream says what the request cost, in "
        "the limit's units, charged after the response (missing or invalid: cost)",
    )
    keep_cost_header: bool = Field(
        False, description="leave the cost header in the response the client gets"
    )
    cost_from: str | None = Field(
        None,
        description="where the response body says what the request cost (an LLM API's "
        "usage), charged after the response: openai, anthropic, a dotted path "
        "(usage.total_tokens) or a sum of paths (usage.prompt_tokens + "
        "usage.completion_tokens); read from a JSON body or as a stream's events pass "
        "(missing: reserve, or cost)",
    )
    reserve: Annotated[int, Field(ge=1)] | ReserveFrom | None = Field(
        None,
        description="units a request of a limit charged after the response holds while in "
        "flight (an estimate of its cost: a model call's most tokens), settled to what the "
        "response says: a number, or {body: max_tokens, default: 4096} read from the "
        "request's JSON body; default: cost",
    )
    hold: Literal["in_flight", "none"] = Field(
        "in_flight",
        description="a limit charged after the response (count, cost_header): in_flight "
        "(each request in flight holds its cost of the key's budget from admission until "
        "its response is settled, so at most the budget left can be in flight) or none "
        "(admitted free while the key has room, charged after: a burst in flight may all "
        "pass)",
    )
    exempt: tuple[str, ...] = Field(
        (), description="CIDRs of clients this limit does not apply to (other limits still do)"
    )
    exempt_headers: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="header name -> values (e.g. an internal service token) whose requests "
        "this limit does not apply to; compared in constant time, never logged",
    )
    plans: dict[Name, dict[str, Any]] = Field(
        default_factory=dict,
        description="named parameter sets (rate/burst, or limit/window) overrides can name",
    )
    overrides: dict[str, Name | dict[str, Any]] = Field(
        default_factory=dict,
        description="key value (or CIDR for a client_ip key) -> a plan's name or its own "
        "parameters; the most specific CIDR wins",
    )
    overrides_file: str | None = Field(
        None,
        description="YAML or JSON file of more overrides (relative to the policy file), "
        "reloaded with the policy",
    )
    plan_from: PlanFrom | None = Field(
        None,
        description="the plan named by the request: {jwt: CLAIM}, a claim of its verified "
        "token whose value is one of plans (another value, or none: the limit's own numbers)",
    )
    unlisted: Literal["own", "shared", "reject"] = Field(
        "own",
        description="keys the overrides do not list (a key a client invents): own (each its "
        "own bucket at the limit's numbers), shared (all of them one bucket), or reject (403)",
    )
    exempt_listed: Name | None = Field(
        None,
        description="the name of another limit: requests whose key that limit's overrides "
        "list (a client on a plan) bypass this limit",
    )

    @field_validator("cost")
    @classmethod
    def _check_cost(cls, value: int | Cost) -> int | Cost:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"cost must be at least 1, got {value}")
        return value

    @field_validator("cost_header")
    @classmethod
    def _check_cost_header(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _HEADER_NAME_RE.match(value):
            raise ValueError(f"invalid header name {value!r} in cost_header")
        if value.lower() in _FRAMING_HEADERS:
            raise ValueError(
                f"{value} frames the response, it cannot be a cost header (removing it would "
                "break the response)"
            )
        return value

    @field_validator("exempt")
    @classmethod
    def _check_exempt(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"invalid CIDR {cidr!r} in exempt") from None
        return value

    @field_validator("exempt_headers")
    @classmethod
    def _check_exempt_headers(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for name, secrets in value.items():
            if not _HEADER_NAME_RE.match(name):
                raise ValueError(f"invalid header name {name!r} in exempt_headers")
            if not secrets or any(not s for s in secrets):
                raise ValueError(f"exempt_headers {name!r}: give one or more non-empty values")
        return value

    @model_validator(mode="after")
    def _check_overrides(self) -> _LimitBase:
        tier_specs(self, self.overrides)
        if self.unlisted != "own" and not (self.overrides or self.overrides_file):
            raise ValueError(
                f"unlisted: {self.unlisted} needs overrides (or an overrides_file) that list "
                "keys: without them every key is unlisted"
            )
        return self

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_key_parts(value, plans=True)

    @model_validator(mode="after")
    def _check_plan_from(self) -> _LimitBase:
        if self.plan_from is None:
            return self
        if not self.plans:
            raise ValueError("plan_from names a plan of plans: define plans")
        if self.overrides or self.overrides_file or self.unlisted != "own":
            raise ValueError(
                "plan_from and overrides (overrides_file, unlisted) both choose a key's plan: "
                "use one of them"
            )
        return self

    @property
    def charged_after(self) -> bool:
        """Whether the limit charges after the response (``count``, ``cost_header``,
        ``cost_from``)."""
        return self.count is not None or self.cost_header is not None or self.cost_from is not None

    @field_validator("cost_from")
    @classmethod
    def _check_cost_from(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cost_from(value)  # BadCostFrom, a ValueError, says what to write
            return value.strip()
        return value

    @model_validator(mode="after")
    def _chargeable_after(self) -> _LimitBase:
        if self.keep_cost_header and self.cost_header is None:
            raise ValueError("keep_cost_header applies to a cost_header: name one, or remove it")
        if "hold" in self.model_fields_set and not self.charged_after:
            raise ValueError(
                "hold applies to a limit charged after the response (count, cost_header or "
                "cost_from): a limit charged at admission holds its cost already; remove hold"
            )
        if self.reserve is not None:
            if not self.charged_after:
                raise ValueError(
                    "reserve applies to a limit charged after the response (cost_from, "
                    "cost_header or count): a limit charged at admission takes its cost; "
                    "remove reserve, or use cost"
                )
            if self.hold == "none":
                raise ValueError(
                    "reserve is what a request holds while in flight, and hold: none holds "
                    "nothing; remove one of them"
                )
            if self.cost != 1:
                raise ValueError(
                    "reserve replaces cost at admission (and is what a missing usage is "
                    "charged): remove cost"
                )
        if self.cost_from is not None and self.cost_header is not None:
            raise ValueError(
                "cost_from and cost_header both say what a response cost: keep one of them"
            )
        if not self.charged_after:
            return self
        given = [
            name
            for name in ("count", "cost_header", "cost_from")
            if getattr(self, name) is not None
        ]
        subject = f"{' and '.join(given)} charge{'' if len(given) > 1 else 's'} after the response"
        algorithm = getattr(self, "algorithm", "")
        if algorithm == "leaky_bucket":
            raise ValueError(
                f"{subject}, which a leaky_bucket cannot: it delays each request by the state "
                "it finds; use a token_bucket in reject mode or a window algorithm"
            )
        if getattr(self, "mode", "reject") != "reject":
            raise ValueError(
                f"{subject}, which a token_bucket in queue mode cannot: a limit charged after "
                "the response never delays; use mode: reject"
            )
        if getattr(self, "warmup", None):
            raise ValueError(
                f"{subject}, which a token_bucket with warmup cannot: its ramp is computed per "
                "request; remove warmup"
            )
        if self.lease is not None:
            raise ValueError(
                f"{subject}, which a leased limit cannot: a lease is a batch of admissions "
                "taken ahead; remove lease"
            )
        return self

    @model_validator(mode="after")
    def _leasable(self) -> _LimitBase:
        if self.lease is None:
            return self
        algorithm = getattr(self, "algorithm", "")
        # A leaky bucket with nodelay never delays: it is leased as a token bucket of burst + 1.
        nodelay = algorithm == "leaky_bucket" and getattr(self, "nodelay", False)
        if algorithm in _NOT_LEASABLE and not nodelay:
            raise ValueError(_NOT_LEASABLE[algorithm])
        if getattr(self, "mode", "reject") != "reject" or getattr(self, "warmup", None):
            raise ValueError(
                "a token_bucket with mode: queue or warmup cannot be leased: its delays and "
                "ramp are computed per request; lease one in reject mode without warmup"
            )
        if self.overrides or self.overrides_file or self.cost != 1:
            # A lease is a batch of one parameter set's unit admissions.
            raise ValueError(
                "a leased limit takes no overrides, overrides_file or cost (not supported yet)"
            )
        return self


class LeakyBucketLimit(_LimitBase):
    """nginx ``limit_req``: ``rate``, ``burst``, and ``nodelay`` or ``delay=N``."""

    algorithm: Literal["leaky_bucket"] = Field(description="nginx limit_req, bit for bit")
    rate: RateField
    burst: int = Field(0, ge=0, description="excess requests admitted (delayed unless nodelay)")
    nodelay: bool = Field(False, description="admit the burst at once instead of delaying it")
    delay: int | None = Field(None, ge=0, description="requests served without delay (nginx)")

    @model_validator(mode="after")
    def _delay_or_nodelay(self) -> LeakyBucketLimit:
        if self.nodelay and self.delay is not None:
            raise ValueError("give nodelay or delay, not both")
        if self.delay is not None and self.delay > self.burst:
            raise ValueError(f"delay ({self.delay}) cannot exceed burst ({self.burst})")
        return self

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``): how long the
        quota, ``burst + 1`` requests, takes to refill."""
        return (self.burst + 1) / self.rate.per_second


# A calendar period's nominal length in seconds (what ``RateLimit-Policy`` advertises as its
# window; a month is 30 days and a year 365, as Kong counts them): the algorithm counts to the
# period's real end.
_NOMINAL_PERIOD_S: dict[str, float] = {
    "1d": 86_400.0,
    "1w": 7 * 86_400.0,
    "1mo": 30 * 86_400.0,
    "1y": 365 * 86_400.0,
}


class WindowLimit(_LimitBase):
    """At most ``limit`` requests per ``window`` (fixed, sliding counter, or exact sliding log)."""

    algorithm: Literal["fixed_window", "sliding_window", "sliding_log"] = Field(
        description="aligned windows (on the calendar with calendar: true); two windows "
        "weighted (approximate); every request's time kept (exact)"
    )
    limit: int = Field(ge=1, description="requests per window")
    window: WindowLength = Field(
        description="the window's length, above 0; with calendar: true, 1d, 1w, 1mo or 1y"
    )
    calendar: bool = Field(
        False,
        description="a fixed window on the calendar: window 1d, 1w (from Monday), 1mo or 1y, "
        "from local midnight in timezone (a daylight-saving day is 23 or 25 hours)",
    )
    timezone: str = Field(
        "UTC", description="IANA time zone of a calendar window ('Europe/Berlin')"
    )

    @field_validator("window")
    @classmethod
    def _positive_window(cls, value: float | str) -> float | str:
        if isinstance(value, float) and value <= 0:
            raise ValueError("window must be longer than 0")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        time_zone(value)
        return value

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``); a calendar
        period's nominal length."""
        if isinstance(self.window, str):
            return _NOMINAL_PERIOD_S[self.window]
        return self.window

    @model_validator(mode="after")
    def _calendar_window(self) -> WindowLimit:
        if not self.calendar:
            if isinstance(self.window, str):
                raise ValueError(
                    f"window {self.window} is a calendar period: add calendar: true (and a "
                    "timezone, UTC if none)"
                )
            if self.timezone != "UTC":
                raise ValueError("timezone applies to a calendar window: add calendar: true")
            return self
        if self.algorithm != "fixed_window":
            raise ValueError(
                f"a calendar window is a fixed window: use algorithm: fixed_window, not "
                f"{self.algorithm}"
            )
        if not isinstance(self.window, str):
            seconds = int(self.window) if self.window.is_integer() else self.window
            raise ValueError(f"a calendar window is 1d, 1w, 1mo or 1y, got a window of {seconds} s")
        if self.lease is not None:
            raise ValueError("a calendar window cannot be leased (not supported yet)")
        return self


class TokenBucketLimit(_LimitBase):
    """``rate`` refill with ``burst`` capacity; ``queue`` waits for tokens (Guava semantics)."""

    algorithm: Literal["token_bucket"] = Field(description="Guava RateLimiter semantics")
    rate: RateField
    burst: int = Field(1, ge=1, description="bucket capacity in tokens")
    mode: Literal["reject", "queue"] = Field(
        "reject", description="reject: no token, no entry; queue: wait for the tokens (Guava)"
    )
    warmup: Duration | None = Field(None, description="ramp from a third of rate to rate")

    @property
    def window_s(self) -> float:
        """The window a response advertises (``w`` of ``RateLimit-Policy``): how long the
        quota, ``burst`` tokens, takes to refill."""
        return self.burst / self.rate.per_second


class ConcurrencyLimit(_LimitBase):
    """nginx ``limit_conn``: at most ``limit`` requests in flight per key (``cost`` slots each),
    a slot held until the response has been sent, the client went away or the upstream
    failed."""

    algorithm: Literal["concurrency"] = Field(
        description="requests in flight per key (nginx limit_conn)"
    )
    limit: int = Field(ge=1, description="slots held at once per key (a request holds cost)")
    max_delay: Duration = Field(
        0.0,
        description="how long a request over the limit may wait for a slot (first come, first "
        "served); 0 rejects it at once, as nginx's limit_conn does",
    )
    retry_after: Duration = Field(
        1.0, description="Retry-After on a rejection (when a slot frees cannot be known)"
    )
    max_keys: int = Field(
        100_000,
        ge=1,
        description="keys holding slots at once; a request under a new key beyond them is "
        "rejected (nginx's full zone), none is evicted",
    )

    @model_validator(mode="after")
    def _cost_fits(self) -> ConcurrencyLimit:
        """Each plan and override is checked so too: ``variant_spec`` validates its limit
        with this cost."""
        cost = self.cost
        if isinstance(cost, int):
            named, largest = "cost", cost
        else:
            costs = {
                "cost.default": cost.default,
                **{f"cost.routes.{name}": value for name, value in cost.routes.items()},
                **{f"cost.methods.{name}": value for name, value in cost.methods.items()},
            }
            named, largest = max(costs.items(), key=lambda item: item[1])
        if largest > self.limit:
            raise ValueError(
                f"{named} ({largest}) exceeds limit ({self.limit}): a request needing more "
                "slots than the limit has could never be admitted"
            )
        return self

    @property
    def window_s(self) -> float:
        """Slots are given back, not refilled: no quota window is advertised for them (the IETF
        draft has no RateLimit field for concurrency)."""
        return 0.0


# The model of each name ``algorithm:`` takes, and the names, for error messages.
ALGORITHM_MODELS: dict[str, type[_LimitBase]] = {
    name: model
    for model in (LeakyBucketLimit, WindowLimit, TokenBucketLimit, ConcurrencyLimit)
    for name in get_args(model.model_fields["algorithm"].annotation)
}
ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_MODELS)
Limit = Annotated[
    LeakyBucketLimit | WindowLimit | TokenBucketLimit | ConcurrencyLimit,
    Field(discriminator="algorithm"),
]


class RateLimitHeaders(_Model):
    """Which rate-limit headers responses carry (on 2xx as well as on rejections)."""

    ietf: bool = Field(True, description="RateLimit-Policy and RateLimit (IETF httpapi draft)")
    x_ratelimit: bool = Field(False, description="X-RateLimit-Limit/-Remaining/-Reset")
    retry_after: bool = Field(True, description="Retry-After on rejections")
    openai: bool = Field(
        False,
        description="OpenAI's x-ratelimit-{limit,remaining,reset}-tokens (limits with "
        "cost_from) and -requests (the others)",
    )

    rejected_by: str | None = Field(
        None,
        description="a header naming the limit that rejected a request (e.g. "
        "X-RateLimit-Rejected-By), on its rejections only; none by default (the problem "
        "body's limit names it always)",
    )

    @field_validator("rejected_by")
    @classmethod
    def _check_rejected_by(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER_NAME_RE.match(value):
            raise ValueError(f"invalid header name {value!r}")
        if value is not None and value.lower() in _FRAMING_HEADERS | {"retry-after"}:
            raise ValueError(f"{value} is a header the gateway writes itself: choose another name")
        return value


class Access(_Model):
    """Allowed clients bypass every limit; denied clients get 403."""

    allow: tuple[str, ...] = Field((), description="CIDRs that bypass every limit")
    deny: tuple[str, ...] = Field((), description="CIDRs answered 403")

    @field_validator("allow", "deny")
    @classmethod
    def _check_cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"invalid CIDR {cidr!r}") from None
        return value
