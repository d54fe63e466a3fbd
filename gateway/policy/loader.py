"""Load a policy file into a validated ``Policy`` snapshot, or fail with file, line and reason.

YAML is composed into nodes first so every key and list item keeps its line; pydantic's error
locations are then mapped back to the deepest line known for that path. Duplicate keys, which
PyYAML would silently let the last one win, are errors here.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Final, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Tag, ValidationError

from gateway.policy.jwt_keys import KeyFileError, load_static_key
from gateway.policy.models import (
    ACCESS_LOG_TAGS,
    ALGORITHM_MODELS,
    ALGORITHMS,
    AccessLogSettings,
    OverrideError,
    Policy,
    headers_limits_read,
    tier_specs,
)
from gateway.policy.overrides_file import OverridesFileError, line_of, read_overrides, resolve_path
from gateway.policy.upstream_tls import TLS_FILES, tls_problem

Loc = tuple[str | int, ...]
# What building a valid policy would refuse, each with its place in the file.
BuildChecks = Callable[[Policy], list[tuple[Loc, str]]]


@dataclass(frozen=True, slots=True)
class PolicyProblem:
    line: int | None
    path: str
    reason: str


class PolicyError(Exception):
    """An invalid policy file; ``str()`` gives one ``file:line: path: reason`` line per problem."""

    def __init__(self, file: str, problems: Iterable[PolicyProblem]) -> None:
        self.file = file
        self.problems = tuple(problems)
        super().__init__(self.format())

    def format(self) -> str:
        return "\n".join(problem_lines(self.file, self.problems))


def problem_lines(file: str, problems: Iterable[PolicyProblem], prefix: str = "") -> list[str]:
    """One ``file:line: path: [prefix]reason`` line per problem."""
    lines = []
    for problem in problems:
        where = f"{file}:{problem.line}" if problem.line is not None else file
        what = f"{problem.path}: {problem.reason}" if problem.path else problem.reason
        lines.append(f"{where}: {prefix}{what}")
    return lines


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    """A validated policy and where it came from."""

    policy: Policy
    source: str
    sha256: str
    # Files the policy names (overrides_file): a change to one reloads the policy too.
    files: tuple[str, ...] = ()
    # What the policy accepts but most likely does not mean: `check` prints them, `run` and a
    # reload log them, none refuses the policy.
    warnings: tuple[PolicyProblem, ...] = ()

    def warning_lines(self) -> list[str]:
        """One ``file:line: warning: path: reason`` line per warning."""
        return problem_lines(self.source, self.warnings, "warning: ")


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class _LineMapBuilder:
    """Builds plain Python data from YAML nodes, recording each path's line (1-based)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.lines: dict[Loc, int] = {}
        self._constructor = yaml.SafeLoader("")

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        self.lines.setdefault(loc, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise PolicyError(
                        self.file,
                        [
                            PolicyProblem(
                                key_node.start_mark.line + 1,
                                format_loc(loc),
                                "mapping keys must be plain scalars",
                            )
                        ],
                    )
                key = self._scalar(key_node)
                if key in result:
                    raise PolicyError(
                        self.file,
                        [
                            PolicyProblem(
                                key_node.start_mark.line + 1,
                                format_loc((*loc, key)),
                                "duplicate key",
                            )
                        ],
                    )
                child = (*loc, key)
                self.lines[child] = key_node.start_mark.line + 1
                result[key] = self.build(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*loc, i)) for i, item in enumerate(node.value)]
        return self._scalar(node)

    def _scalar(self, node: yaml.Node) -> Any:
        # The composer has resolved the tag (an empty value is null): construct from it, as
        # safe_load would, without serialising the node again (an empty one cannot be).
        return self._constructor.construct_object(node, deep=True)


def _data_loc(data: Any, loc: Loc) -> Loc:
    """Drop the parts pydantic adds that are not in the file (union tags such as the algorithm).

    The last part may name a missing field, so it is kept when it cannot be followed.
    """
    out: list[str | int] = []
    node = data
    for i, part in enumerate(loc):
        followable = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node)
        )
        if followable:
            node = node[part]
            out.append(part)
        elif part == "[key]":
            pass  # pydantic's marker for an invalid mapping key: the key itself is the place
        elif i == len(loc) - 1 and part in ACCESS_LOG_TAGS and not isinstance(node, dict):
            pass  # the member of ``access_log: true | {...}`` tried on a scalar: not in the file
        elif i == len(loc) - 1 and not (isinstance(node, dict) and part in node.values()):
            out.append(part)
        # else: a tag pydantic inserted for a tagged union; not part of the file's structure.
    return tuple(out)


def _line_for(lines: dict[Loc, int], loc: Loc) -> int | None:
    for end in range(len(loc), -1, -1):
        line = lines.get(tuple(loc[:end]))
        if line is not None:
            return line
    return None


def _unwrap(tp: Any) -> Any:
    """The type inside ``Annotated[...]`` and ``X | None``."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif get_origin(tp) in (Union, UnionType):
            members = [m for m in get_args(tp) if m is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _step(tp: Any, part: str | int) -> Any:
    """The type found at ``part`` inside ``tp`` (None when the path leaves the schema)."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else None
    origin = get_origin(tp)
    if origin is dict:
        return get_args(tp)[1]
    if origin is tuple:
        return get_args(tp)[0]
    if origin in (Union, UnionType):
        # A tagged union: pydantic's location names the tag (the algorithm) here.
        for member in get_args(tp):
            if get_origin(member) is Annotated and any(
                isinstance(meta, Tag) and meta.tag == part for meta in member.__metadata__
            ):
                return get_args(member)[0]  # a member told apart by a Tag (access_log's)
            member = _unwrap(member)
            tag = member.model_fields.get("algorithm") if _is_model(member) else None
            if tag is not None and part in get_args(tag.annotation):
                return member
    return None


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _did_you_mean(raw_loc: Loc) -> str:
    """A hint naming the known key closest to a misspelt one, if one is close."""
    tp: Any = Policy
    for part in raw_loc[:-1]:
        tp = _step(tp, part)
    tp = _unwrap(tp)
    if not _is_model(tp) or not isinstance(raw_loc[-1], str):
        return ""
    close = difflib.get_close_matches(raw_loc[-1], list(tp.model_fields), n=1, cutoff=0.6)
    return f": did you mean `{close[0]}`?" if close else ""


# How an algorithm does what another's parameter asks for, where it has a way.
_WINDOWS_INSTEAD: Final = "; it never delays: a request over the limit is rejected"
_INSTEAD: Final = {
    "token_bucket": "; it rejects what it cannot admit (mode: reject) or waits for tokens "
    "(mode: queue)",
    "leaky_bucket": "; it delays excess requests (nodelay: true admits a burst at once)",
    "fixed_window": _WINDOWS_INSTEAD,
    "sliding_window": _WINDOWS_INSTEAD,
    "sliding_log": _WINDOWS_INSTEAD,
}


def _other_algorithms(data: Any, loc: Loc) -> str | None:
    """A limit given another algorithm's parameter (``nodelay`` on a token bucket): which
    algorithms take it, rather than the nearest spelling among its own fields."""
    if len(loc) != 3 or loc[0] != "limits" or not isinstance(loc[2], str):
        return None
    spec = data["limits"].get(loc[1]) if isinstance(data.get("limits"), dict) else None
    algorithm = spec.get("algorithm") if isinstance(spec, dict) else None
    owners = [name for name, model in ALGORITHM_MODELS.items() if loc[2] in model.model_fields]
    if not isinstance(algorithm, str) or not owners:
        return None
    do = "does" if len(owners) == 1 else "do"
    instead = _INSTEAD.get(algorithm, "")
    return f"a {algorithm} does not take {loc[2]} ({', '.join(owners)} {do}){instead}"


def _tag_problem(loc: Loc, error: Any, data: Any) -> tuple[Loc, str]:
    """An unknown or missing algorithm, on the line of ``algorithm:``, naming those there are
    (and a misspelt ``algorithm:`` key, on its line)."""
    known = ", ".join(ALGORITHMS)
    tag = error.get("ctx", {}).get("tag")
    if error["type"] == "union_tag_invalid":
        return (*loc, "algorithm"), f"unknown algorithm {tag!r}: expected one of {known}"
    spec: Any = data
    for part in loc:
        spec = spec.get(part) if isinstance(spec, dict) else None
    keys = [key for key in spec if isinstance(key, str)] if isinstance(spec, dict) else []
    misspelt = difflib.get_close_matches("algorithm", keys, n=1, cutoff=0.7)
    if misspelt:
        return (*loc, misspelt[0]), "unknown key: did you mean `algorithm`?"
    return loc, f"algorithm is missing: give one of {known}"


_TYPE_NAMES: dict[type, str] = {
    list: "a list",
    dict: "a mapping",
    bool: "true/false",
    int: "a number",
    float: "a number",
}
# The parameters of each family of algorithms, and a rate's period as a window.
_WINDOW_PARAMS = ("limit", "window")
_BUCKET_PARAMS = ("rate", "burst")
_CONCURRENCY_PARAMS = ("limit",)
_PERIODS = {"s": "1s", "m": "1m", "h": "1h", "d": "24h"}


def _given(value: Any) -> str:
    for kind, name in _TYPE_NAMES.items():
        if value.__class__ is kind:
            return name
    return repr(value)


class _Secret:
    """A secret's value in an error message (which a failed reload logs): never its text."""

    def __repr__(self) -> str:
        return "text (not shown: a secret)"


def _is_secret(loc: Loc) -> bool:
    """The admin token and exempt_headers' accepted values (internal service tokens)."""
    return "exempt_headers" in loc or loc[-1:] == ("admin_token",)


def _in_words(error: Any, loc: Loc) -> str:
    """Pydantic's message for one error, in the policy's terms where pydantic's are its own."""
    kind = error["type"]
    given = error.get("input")
    if isinstance(given, str) and _is_secret(loc):
        given = _Secret()
    field = loc[-1] if loc else ""
    if kind == "missing":
        return f"missing: {field} has no default, add it"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        if field == "limit" and isinstance(given, str) and "/" in given:
            return _limit_as_rate(given)
        return f"expected a whole number, got {_given(given)}"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {_given(given)}"
    if kind == "bool_parsing" or kind == "bool_type":
        return f"expected true or false, got {_given(given)}"
    if kind == "string_type":
        what = "one URL" if field == "url" else "text"
        if isinstance(given, dict) and len(given) == 1 and not _is_secret(loc):
            # `header: X-Api-Key` (a space after the colon) is a mapping to YAML.
            ((name, value),) = given.items()
            written = f"{name}:{'' if value is None else value}"
            return (
                f"expected {what}, got a mapping: a space after a colon makes one in YAML; "
                f"write {written} with no space, or quote it ('{written}')"
            )
        return f"expected {what}, got {_given(given)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        wrapper = _LIST_UNDER.get(str(field))
        if wrapper is not None and isinstance(given, list):
            items = ", ".join(str(item) for item in given)
            return f"expected a mapping, got a list: write {field}: {{{wrapper}: [{items}]}}"
        return f"expected a mapping (name: value lines), got {_given(given)}"
    if kind in ("tuple_type", "list_type"):
        return f"expected a list, got {_given(given)}"
    bound = _bound_in_words(kind, error.get("ctx", {}))
    if bound is not None:
        # A token's length, never the token itself.
        return bound if kind == "string_too_short" else f"{bound}, got {given!r}"
    if kind == "string_pattern_mismatch":
        if field == "key_prefix":
            return f"invalid key_prefix {given!r}: no braces (Redis hash tags) and no spaces"
        return f"invalid {field} {given!r}: expected text matching {error['ctx']['pattern']}"
    if kind == "literal_error":
        if loc == ("version",):
            return f"unsupported policy version {given!r}: this gateway reads version: 1"
        return f"expected {error.get('ctx', {}).get('expected', 'another value')}, got {given!r}"
    reason: str = error["msg"]
    return reason.removeprefix("Value error, ")


# Sections that are a mapping around one list, written as the bare list by mistake.
_LIST_UNDER: Final = {"count": "statuses"}

_BOUNDS: Final = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "above"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "below"),
    "string_too_short": ("min_length", "at least"),
}


def _bound_in_words(kind: str, ctx: dict[str, Any]) -> str | None:
    """pydantic's "Input should be greater than or equal to 1": ``must be at least 1``."""
    if kind not in _BOUNDS:
        return None
    name, words = _BOUNDS[kind]
    unit = " characters long" if kind == "string_too_short" else ""
    bound = ctx[name]
    shown = f"{bound:g}" if isinstance(bound, float) else str(bound)
    return f"must be {words} {shown}{unit}"


def _limit_as_rate(given: str) -> str:
    """``limit: 5/m`` on a window algorithm: the count and the window written apart."""
    count, _, period = given.partition("/")
    count = count.strip().removesuffix("r").strip()
    window = _PERIODS.get(period.strip()[:1], "1m") if period.strip() else "1m"
    example = f"limit: {count}, window: {window}" if count.isdigit() else "limit: 5, window: 1m"
    return f"limit counts requests per window: write {example} (not {given!r})"


def _limit_shape_problems(data: Any) -> tuple[list[tuple[Loc, str]], set[Loc]]:
    """A limit given the other family's parameters (``rate:`` on a window algorithm, ``limit:``
    on a bucket): one problem naming what its algorithm takes, in place of pydantic's
    "unknown key" and "Field required" for each parameter. Also the places it covers."""
    problems: list[tuple[Loc, str]] = []
    covered: set[Loc] = set()
    limits = data.get("limits") if isinstance(data, dict) else None
    if not isinstance(limits, dict):
        return problems, covered
    for name, spec in limits.items():
        if not isinstance(spec, dict) or spec.get("algorithm") not in ALGORITHMS:
            continue
        algorithm = spec["algorithm"]
        takes, other = (
            (_BUCKET_PARAMS, _WINDOW_PARAMS)
            if algorithm in ("leaky_bucket", "token_bucket")
            else (_CONCURRENCY_PARAMS, _BUCKET_PARAMS)
            if algorithm == "concurrency"
            else (_WINDOW_PARAMS, _BUCKET_PARAMS)
        )
        wrong = [key for key in other if key in spec]
        if not wrong:
            continue
        if takes == _CONCURRENCY_PARAMS:
            # Requests in flight, not over time: no window to convert a rate to.
            reason = (
                f"a concurrency takes limit (requests in flight at once per key), not "
                f"{' and '.join(wrong)}" + _rate_elsewhere(spec, wrong)
            )
        else:
            reason = (
                f"a {algorithm} takes {' and '.join(takes)}, not {' and '.join(wrong)}"
                + _converted(spec, takes)
            )
        problems.append((("limits", name, wrong[0]), reason))
        covered.update(("limits", name, key) for key in (*takes, *wrong))
    return problems, covered


def _rate_elsewhere(spec: dict[str, Any], wrong: list[str]) -> str:
    """Where a bucket's parameters given to a concurrency limit belong: a bucket, or a
    window."""
    rate = spec.get("rate")
    if isinstance(rate, str):
        count, _, period = rate.strip().partition("r/")
        if count.isdigit() and period in _PERIODS:
            return (
                f": for {rate} use a leaky_bucket or token_bucket (rate: {rate}), or a "
                f"fixed_window (limit: {count}, window: {_PERIODS[period]})"
            )
    verb = "belongs" if len(wrong) == 1 else "belong"
    return f": {' and '.join(wrong)} {verb} to a leaky_bucket or token_bucket"


def _converted(spec: dict[str, Any], takes: tuple[str, ...]) -> str:
    """The same numbers in the parameters the algorithm takes, when they convert plainly."""
    if takes == _WINDOW_PARAMS and isinstance(spec.get("rate"), str):
        count, _, period = spec["rate"].strip().partition("r/")
        if count.isdigit() and period in _PERIODS:
            return f" (for {spec['rate']}: limit: {count}, window: {_PERIODS[period]})"
    if takes == _BUCKET_PARAMS and isinstance(spec.get("limit"), int):
        window = spec.get("window")
        if window in ("1s", "1m"):
            return f" (for {spec['limit']} per {window}: rate: {spec['limit']}r/{window[1]})"
    return ""


def _parse_yaml(text: str, file: str) -> tuple[Any, dict[Loc, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        reason = f"invalid YAML: {exc.problem or exc.context}"
        opened = exc.context_mark
        plain = _yaml_in_words(exc)
        if plain is not None:
            reason = f"invalid YAML: {plain}"
        elif exc.problem and exc.context and opened is not None and opened.line + 1 != line:
            # Where parsing stopped is often far from the mistake: an unclosed bracket or
            # quote is found at the end of the file. Name where the construct started too.
            reason += f" ({exc.context} that starts on line {opened.line + 1})"
        raise PolicyError(file, [PolicyProblem(line, "", reason)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError(file, [PolicyProblem(None, "", f"invalid YAML: {exc}")]) from None
    if node is None:
        return {}, {}
    builder = _LineMapBuilder(file)
    return builder.build(node, ()), builder.lines


def _yaml_in_words(exc: yaml.MarkedYAMLError) -> str | None:
    """The YAML mistakes PyYAML names in parser tokens (``<block end>``), in the file's terms."""
    problem = exc.problem or ""
    mark, opened = exc.problem_mark, exc.context_mark
    if problem.startswith("expected <block end>, but found") and mark is not None:
        where = ""
        if opened is not None:
            where = f" (the block from line {opened.line + 1} is indented {opened.column})"
        return (
            f"this line is indented {mark.column} spaces, which lines up with no key above it: "
            f"indent it as far as the key it belongs beside{where}"
        )
    if "'\\t' that cannot start any token" in problem:
        return "a tab character: YAML indents with spaces only"
    return None


def _parse_toml(text: str, file: str) -> tuple[Any, dict[Loc, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib before Python 3.14 keeps the place only in its message: "(at line 3, column
        # 11)"; the line goes where every problem's line goes.
        reason = str(exc)
        place = re.search(r" \(at line (\d+), column (\d+)\)$", reason)
        line = getattr(exc, "lineno", None)
        if place is not None:
            line = line or int(place[1])
            reason = f"{reason[: place.start()]} (column {place[2]})"
        raise PolicyError(file, [PolicyProblem(line, "", f"invalid TOML: {reason}")]) from None
    return data, _toml_key_lines(text)


def yaml_with_lines(text: str, file: str) -> tuple[Any, dict[Loc, int]]:
    """YAML read as a policy is: plain data and the line of each path, or a ``PolicyError``
    (for the other files operators write beside a policy: its test cases)."""
    return _parse_yaml(text, file)


def line_for(lines: dict[Loc, int], loc: Loc) -> int | None:
    """The line of ``loc``, or of the deepest part of it the file has."""
    return _line_for(lines, loc)


def error_in_words(error: Any, data: Any) -> tuple[Loc, str]:
    """One pydantic error of a model other than the policy's, placed in the file and put in
    the policy's words (``expected a whole number, got ...``)."""
    loc = _data_loc(data, tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        return loc, "unknown key"
    return loc, _in_words(error, loc)


def _toml_key_lines(text: str) -> dict[Loc, int]:
    """Best-effort lines for TOML: tables and their keys (tomllib keeps no positions)."""
    lines: dict[Loc, int] = {}
    table: Loc = ()
    counters: dict[Loc, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("[["):
            name = tuple(stripped.strip("[]").strip().split("."))
            index = counters.get(name, 0)
            counters[name] = index + 1
            table = (*name, index)
            lines.setdefault(table, number)
        elif stripped.startswith("["):
            table = tuple(stripped.strip("[]").strip().split("."))
            lines.setdefault(table, number)
        elif "=" in stripped and not stripped.startswith("#"):
            key = stripped.split("=", 1)[0].strip().strip('"')
            lines.setdefault((*table, *key.split(".")), number)
    return lines


def _check_references(policy: Policy) -> list[tuple[Loc, str]]:
    """What the schema alone cannot see: names that must exist."""
    problems: list[tuple[Loc, str]] = []
    if not policy.routes:
        # An empty file (a template that rendered nothing, an editor that truncated first)
        # would otherwise load and answer every request with 404.
        problems.append(
            (
                ("routes",),
                "the policy routes nothing: every request would get 404; "
                "define at least one route (an empty or truncated file?)",
            )
        )
    for i, route in enumerate(policy.routes):
        if route.upstream not in policy.upstreams:
            known = ", ".join(sorted(policy.upstreams)) or "none defined"
            problems.append(
                (("routes", i, "upstream"), f"unknown upstream {route.upstream!r} (known: {known})")
            )
    route_names = {route.name for route in policy.routes}
    known = ", ".join(sorted(route_names)) or "none defined"
    for name, limit in policy.limits.items():
        for route_name in limit.match.routes or ():
            if route_name not in route_names:
                problems.append(
                    (
                        ("limits", name, "match", "routes"),
                        f"unknown route {route_name!r} (routes: {known})",
                    )
                )
        cost = limit.cost
        for route_name in () if isinstance(cost, int) else cost.routes:
            if route_name not in route_names:
                problems.append(
                    (
                        ("limits", name, "cost", "routes", route_name),
                        f"unknown route {route_name!r} (routes: {known})",
                    )
                )
        if limit.exempt_listed is not None:
            reason = _names_a_lister(policy, name, limit.exempt_listed)
            if reason is not None:
                problems.append((("limits", name, "exempt_listed"), reason))
        if policy.jwt is None:
            reads = "plan_from" if limit.plan_from is not None else None
            reads = next((p for p in limit.key if p.startswith("jwt:")), reads)
            if reads is not None:
                loc = ("limits", name, "plan_from" if reads == "plan_from" else "key")
                problems.append(
                    (
                        loc,
                        f"{reads} reads the request's token: configure jwt (secret_file, "
                        "public_key_file or jwks_url)",
                    )
                )
        for part in limit.key:
            if part.startswith("plan:"):
                reason = _names_a_lister(policy, name, part[len("plan:") :])
                if reason is not None:
                    problems.append((("limits", name, "key"), f"{part}: {reason}"))
    problems += _raw_exempt_headers(policy)
    seen: dict[str, int] = {}
    for i, route in enumerate(policy.routes):
        if route.name in seen:
            problems.append(
                (
                    ("routes", i, "name"),
                    f"duplicate route name {route.name!r} (first at routes[{seen[route.name]}])",
                )
            )
        seen.setdefault(route.name, i)
    return problems


def _raw_exempt_headers(policy: Policy) -> list[tuple[Loc, str]]:
    """``access_log.raw`` naming a header of ``exempt_headers``: its values are secrets."""
    settings = policy.server.access_log
    if not isinstance(settings, AccessLogSettings) or not settings.raw:
        return []
    exempt = headers_limits_read(policy)[1]
    return [
        (
            ("server", "access_log", "raw"),
            f"{name} is an exempt_headers header, whose values let a client past a limit: "
            f"the access log writes it hashed only (take {name} out of raw)",
        )
        for name in settings.raw
        if name.lower() in exempt
    ]


def _policy_warnings(policy: Policy) -> list[tuple[Loc, str]]:
    """What the policy accepts but most likely does not mean, each at its place."""
    warnings: list[tuple[Loc, str]] = []
    for name, limit in policy.limits.items():
        parts = [p for p in limit.key if p.startswith(("header:", "query:"))]
        if limit.unlisted == "reject" and limit.on_missing_key == "skip" and parts:
            warnings.append(
                (
                    ("limits", name, "unlisted"),
                    f"reject, but a request without {' or '.join(parts)} skips this limit "
                    "(on_missing_key: skip, the default) rather than being rejected: set "
                    "on_missing_key: client_ip to reject it as unlisted too",
                )
            )
    return warnings


def _names_a_lister(policy: Policy, name: str, other_name: str) -> str | None:
    """Why limit ``name`` cannot read the keys limit ``other_name`` lists (``exempt_listed``,
    ``plan:`` key parts), or None."""
    other = policy.limits.get(other_name)
    if other_name == name:
        return "a limit cannot read the keys it lists itself: name another limit"
    if other is None:
        known = ", ".join(sorted(set(policy.limits) - {name})) or "none defined"
        return f"unknown limit {other_name!r} (limits: {known})"
    if not other.overrides:
        return f"limit {other_name!r} lists no key: it has no overrides"
    if any(part.startswith("plan:") for part in other.key):
        return f"limit {other_name!r} is keyed by a plan itself: name the limit that lists keys"
    return None


def parse_policy(
    text: str, file: str = "<policy>", checks: BuildChecks | None = None
) -> LoadedPolicy:
    """Validate policy text; the format follows the file's extension (``.toml`` or YAML).
    ``checks`` sees a policy the schema and its references accept, and names what building
    it would refuse (``engine.preflight`` hands in the store's and the algorithms'), each
    reported with its line as the schema's problems are."""
    if file.endswith(".toml"):
        data, lines = _parse_toml(text, file)
    else:
        data, lines = _parse_yaml(text, file)
    if not isinstance(data, dict):
        raise PolicyError(file, [PolicyProblem(1, "", "the policy file must be a mapping")])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        problems = []
        shapes, covered = _limit_shape_problems(data)
        for loc, reason in shapes:
            problems.append(PolicyProblem(_line_for(lines, loc), format_loc(loc), reason))
        for error in exc.errors(include_url=False):
            raw_loc = tuple(error["loc"])
            loc = _data_loc(data, raw_loc)
            if loc in covered:
                continue
            reason = _in_words(error, loc)
            if error["type"] == "extra_forbidden":
                reason = _other_algorithms(data, loc) or "unknown key" + _did_you_mean(raw_loc)
            elif error["type"] in ("model_type", "dict_type") and error["input"] is None:
                reason = "is empty: write its settings under it, or remove the line"
            elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
                loc, reason = _tag_problem(loc, error, data)
            problems.append(PolicyProblem(_line_for(lines, loc), format_loc(loc), reason))
        raise PolicyError(file, problems) from None
    policy, files, digest_parts = _with_overrides_files(policy, file, lines)
    policy, tls_problems = _with_tls_files(policy, file)
    policy = _with_admin_token_file(policy, file)
    policy = _with_access_log_path(policy, file)
    policy, jwt_problems = _with_jwt_files(policy, file)
    # The JWT key file is watched (a key rotated in place is read again by a reload), not
    # digested: a secret's content has no place in a digest the gateway shows.
    jwt = policy.jwt
    key_file = (jwt.secret_file or jwt.public_key_file) if jwt is not None else None
    if key_file is not None and not jwt_problems:
        files = (*files, key_file)
    tls_problems += jwt_problems
    ref_problems = _check_references(policy) or tls_problems or (checks(policy) if checks else [])
    if ref_problems:
        raise PolicyError(
            file,
            [
                PolicyProblem(_line_for(lines, loc), format_loc(loc), reason)
                for loc, reason in ref_problems
            ],
        )
    digest = hashlib.sha256(text.encode())
    for part in digest_parts:
        digest.update(b"\0" + part.encode())
    warnings = tuple(
        PolicyProblem(_line_for(lines, loc), format_loc(loc), reason)
        for loc, reason in _policy_warnings(policy)
    )
    return LoadedPolicy(
        policy=policy, source=file, sha256=digest.hexdigest(), files=files, warnings=warnings
    )


def _with_overrides_files(
    policy: Policy, file: str, lines: dict[Loc, int]
) -> tuple[Policy, tuple[str, ...], list[str]]:
    """The policy with each limit's ``overrides_file`` read into its ``overrides`` (the
    policy's own entries win), the files read, and their names and texts for the digest."""
    limits = dict(policy.limits)
    files: list[str] = []
    digest_parts: list[str] = []
    for name, spec in policy.limits.items():
        if spec.overrides_file is None:
            continue
        path = resolve_path(file, spec.overrides_file)
        try:
            entries, text = read_overrides(path)
        except OverridesFileError as exc:
            raise PolicyError(exc.file, [PolicyProblem(exc.line, "", exc.reason)]) from None
        try:
            tier_specs(spec, entries)
        except OverrideError as exc:
            raise PolicyError(
                str(path), [PolicyProblem(line_of(text, exc.entry), "", str(exc))]
            ) from None
        except ValueError as exc:
            loc: Loc = ("limits", name, "overrides_file")
            raise PolicyError(
                file, [PolicyProblem(_line_for(lines, loc), format_loc(loc), str(exc))]
            ) from None
        limits[name] = spec.model_copy(update={"overrides": {**entries, **spec.overrides}})
        files.append(str(path))
        digest_parts += [str(path), text]
    if not files:
        return policy, (), []
    return policy.model_copy(update={"limits": limits}), tuple(files), digest_parts


def _with_tls_files(policy: Policy, file: str) -> tuple[Policy, list[tuple[Loc, str]]]:
    """The policy with each upstream's TLS files relative to the policy file's directory, and
    the files that cannot be used (built as ``run`` builds them)."""
    upstreams = dict(policy.upstreams)
    problems: list[tuple[Loc, str]] = []
    for name, upstream in policy.upstreams.items():
        given = {s: getattr(upstream, s) for s in TLS_FILES if getattr(upstream, s)}
        if not given:
            continue
        resolved = {s: str(resolve_path(file, path)) for s, path in given.items()}
        upstream = upstreams[name] = upstream.model_copy(update=resolved)
        problem = tls_problem(upstream)
        if problem is not None:
            setting, reason = problem
            problems.append((("upstreams", name, setting), reason))
    if upstreams == policy.upstreams:
        return policy, problems
    return policy.model_copy(update={"upstreams": upstreams}), problems


def _with_admin_token_file(policy: Policy, file: str) -> Policy:
    """The policy with ``server.admin_token_file`` relative to the policy file's directory, as
    its other files are (not to the directory the gateway was started in)."""
    given = policy.server.admin_token_file
    if not given:
        return policy
    resolved = str(resolve_path(file, given))
    if resolved == given:
        return policy
    server = policy.server.model_copy(update={"admin_token_file": resolved})
    return policy.model_copy(update={"server": server})


def _with_jwt_files(policy: Policy, file: str) -> tuple[Policy, list[tuple[Loc, str]]]:
    """The policy with ``jwt``'s key files relative to the policy file's directory, and the
    one that cannot be used (read and parsed as ``run`` reads it)."""
    settings = policy.jwt
    if settings is None or settings.jwks_url is not None:
        return policy, []
    update = {
        name: str(resolve_path(file, given))
        for name in ("secret_file", "public_key_file")
        if (given := getattr(settings, name)) is not None
    }
    settings = settings.model_copy(update=update)
    try:
        load_static_key(settings)
    except KeyFileError as exc:
        return policy, [(("jwt", exc.setting), exc.reason)]
    return policy.model_copy(update={"jwt": settings}), []


def _with_access_log_path(policy: Policy, file: str) -> Policy:
    """The policy with ``server.access_log.path`` relative to the policy file's directory."""
    settings = policy.server.access_log
    if not isinstance(settings, AccessLogSettings) or not settings.path:
        return policy
    resolved = str(resolve_path(file, settings.path))
    if resolved == settings.path:
        return policy
    server = policy.server.model_copy(
        update={"access_log": settings.model_copy(update={"path": resolved})}
    )
    return policy.model_copy(update={"server": server})


def load_policy(path: str | Path, checks: BuildChecks | None = None) -> LoadedPolicy:
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(file, [PolicyProblem(None, "", f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise PolicyError(file, [PolicyProblem(None, "", "not valid UTF-8")]) from None
    return parse_policy(text, file, checks)
