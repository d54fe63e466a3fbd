"""Policy files: valid ones load; each invalid fixture fails with its exact file:line: reason."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.engine.preflight import load_and_build, parse_and_build
from gateway.policy.loader import PolicyError

FIXTURES = Path(__file__).parent / "fixtures"
INVALID = FIXTURES / "invalid"

# file -> the one line `gateway check` must print (path relative to tests/fixtures/invalid).
EXPECTED_ERRORS = {
    "empty_section.yaml": "empty_section.yaml:2: server: is empty: write its settings under it, "
    "or remove the line",
    "bad_duration.yaml": "bad_duration.yaml:3: server.header_timeout: invalid duration '10x': "
    "expected Go syntax like '500ms', '10s', '1m30s'",
    "bad_listen.yaml": "bad_listen.yaml:2: server.listen: invalid listen address 'localhost': "
    "expected HOST:PORT, e.g. 0.0.0.0:8080",
    "bad_size.yaml": "bad_size.yaml:2: server.max_body_size: invalid size '10q': "
    "expected bytes or nginx syntax like '64k', '10m'",
    "bad_cidr.yaml": "bad_cidr.yaml:2: server.trusted_proxies: invalid CIDR '300.1.2.3/8' "
    "in trusted_proxies",
    "zero_workers.yaml": "zero_workers.yaml:2: server.workers: must be at least 1, got 0",
    "bad_upstream_url.yaml": "bad_upstream_url.yaml:3: upstreams.backend.url: invalid upstream "
    "url 'ftp://example': expected http://host[:port][/path] or https://host[:port][/path], "
    "or 'builtin:demo'",
    "unknown_upstream.yaml": "unknown_upstream.yaml:6: routes[0].upstream: unknown upstream "
    "'missing' (known: backend)",
    "duplicate_route.yaml": "duplicate_route.yaml:7: routes[1].name: duplicate route name 'api' "
    "(first at routes[0])",
    "two_path_rules.yaml": "two_path_rules.yaml:7: routes[0].match: give at most one of "
    "path_prefix, path, path_regex (got ['path_prefix', 'path'])",
    "bad_regex.yaml": "bad_regex.yaml:8: routes[0].match.path_regex: invalid path_regex '/a(': "
    "missing ), unterminated subpattern at position 2",
    "relative_path.yaml": "relative_path.yaml:8: routes[0].match.path_prefix: path 'api' must "
    "start with '/'",
    "unknown_key.yaml": "unknown_key.yaml:7: routes[0].colour: unknown key",
    "limit_misspelt_key.yaml": "limit_misspelt_key.yaml:11: limits.per_ip.brust: unknown key: "
    "did you mean `burst`?",
    "misspelt_section.yaml": "misspelt_section.yaml:7: routes[0].mtach: unknown key: "
    "did you mean `match`?",
    "duplicate_key.yaml": "duplicate_key.yaml:3: server.listen: duplicate key",
    "yaml_syntax.yaml": "yaml_syntax.yaml:3: invalid YAML: expected ',' or ']', but got "
    "'<stream end>' (while parsing a flow sequence that starts on line 2)",
    "not_a_mapping.yaml": "not_a_mapping.yaml:1: the policy file must be a mapping",
    "bad_version.yaml": "bad_version.yaml:1: version: unsupported policy version 2: this "
    "gateway reads version: 1",
    "missing_url.yaml": "missing_url.yaml:2: upstreams.backend: give url (one server) or "
    "servers (a pool), one of them",
    "pool_hash_without_key.yaml": "pool_hash_without_key.yaml:2: upstreams.backend: balance: "
    "hash needs hash_key, and hash_key needs balance: hash",
    "pool_all_backup.yaml": "pool_all_backup.yaml:2: upstreams.backend: every server is a "
    "backup: at least one must not be",
    "pool_retry_bad_status.yaml": "pool_retry_bad_status.yaml:5: upstreams.backend.retry.when[1]: "
    "expected 'error', 'timeout', 500, 502, 503, 504, 403, 404 or 429, got 501",
    "route_zero_read_timeout.yaml": "route_zero_read_timeout.yaml:7: routes[0].read_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "tls_bad_min_version.yaml": "tls_bad_min_version.yaml:2: server.tls.min_version: expected "
    "'1.2' or '1.3', got '1.1'",
    "tls_missing_files.yaml": "tls_missing_files.yaml:2: server.tls: "
    "{dir}/missing-cert.pem: cannot read: No such file or directory",
    "bad_workers.toml": "bad_workers.toml:3: server.workers: expected a whole number, got 'many'",
    "listen_same_port_twice.yaml": "listen_same_port_twice.yaml:2: server.listen: listen[0] "
    "(127.0.0.1:8080) and listen[1] (0.0.0.0:8080) take the same port: give each listener its own",
    "listen_redirect_without_tls.yaml": "listen_redirect_without_tls.yaml:2: server.listen: "
    "listen[0] redirects to HTTPS but no listener has tls: add one, or give redirect_to_https "
    "the port clients reach HTTPS on",
    "listen_list_and_server_tls.yaml": "listen_list_and_server_tls.yaml:1: server: tls is for a "
    "listen address; with listen as a list, give the TLS listener its own tls",
    "tls_two_defaults.yaml": "tls_two_defaults.yaml:4: server.listen[0].tls: certificates[0] and "
    "certificates[1] are both the default: give default: true to one",
    "tls_server_name_twice.yaml": "tls_server_name_twice.yaml:2: server.tls: server name "
    "'a.test' is in certificates[0] and certificates[1]: list it once",
    "tls_bad_server_name.yaml": "tls_bad_server_name.yaml:4: "
    "server.tls.certificates[0].server_names: invalid server name 'api.*': expected a host name "
    "(api.example.com) or a wildcard over a domain (*.example.com)",
    "tls_certificate_missing_file.yaml": "tls_certificate_missing_file.yaml:6: "
    "server.listen[0].tls.certificates[0]: {dir}/missing-cert.pem: cannot read: No such file or "
    "directory",
    "limit_delay_over_burst.yaml": "limit_delay_over_burst.yaml:8: limits.per_ip: delay (5) "
    "cannot exceed burst (2)",
    "limit_delay_and_nodelay.yaml": "limit_delay_and_nodelay.yaml:8: limits.per_ip: give "
    "nodelay or delay, not both",
    "limit_bad_rate.yaml": "limit_bad_rate.yaml:10: limits.per_ip.rate: invalid rate '10r/h': "
    "expected nginx syntax like '10r/s' or '30r/m'",
    "limit_unknown_algorithm.yaml": "limit_unknown_algorithm.yaml:9: limits.per_ip.algorithm: "
    "unknown algorithm 'leaky': expected one of leaky_bucket, fixed_window, sliding_window, "
    "sliding_log, token_bucket, concurrency",
    "limit_zero_window.yaml": "limit_zero_window.yaml:11: limits.per_ip.window: window must be "
    "longer than 0",
    "limit_bad_key.yaml": "limit_bad_key.yaml:12: limits.per_ip.key: invalid key part "
    "'cookie:session': expected client_ip, header:NAME, query:NAME, route, method, global, "
    "const:TEXT, plan:LIMIT, jwt:CLAIM or body:FIELD (a JSON field of the request body: "
    "model, metadata.user)",
    "limit_unknown_route.yaml": "limit_unknown_route.yaml:13: limits.per_ip.match.routes: "
    "unknown route 'nope' (routes: api)",
    "limit_missing_limit.yaml": "limit_missing_limit.yaml:8: limits.per_ip.limit: missing: "
    "limit has no default, add it",
    "store_bad_url.yaml": "store_bad_url.yaml:2: store.url: invalid store url 'mysql://db': "
    "expected memory, shared, redis://, rediss:// or redis+cluster://",
    "store_bad_key_prefix.yaml": "store_bad_key_prefix.yaml:3: store.key_prefix: invalid "
    "key_prefix 'gw:{tenant}:': no braces (Redis hash tags) and no spaces",
    "route_bad_method.yaml": "route_bad_method.yaml:8: routes[0].match.methods: "
    "invalid method 'P0ST': expected a method name like GET",
    "route_bad_name.yaml": "route_bad_name.yaml:5: routes[0].name: invalid name 'login api': "
    "use ASCII letters, digits, '_', '.' and '-', starting with a letter or digit",
    "limit_empty_key.yaml": "limit_empty_key.yaml:12: limits.per_ip.key: "
    "key needs at least one part",
    "access_bad_allow.yaml": "access_bad_allow.yaml:2: access.allow: invalid CIDR '192.168.0.0/33'",
    "access_bad_deny.yaml": "access_bad_deny.yaml:2: access.deny: invalid CIDR '2001:db8::g/64'",
    "limit_zero_rate.yaml": "limit_zero_rate.yaml:10: limits.per_ip.rate: invalid rate '0r/s': "
    "must be at least 1 request",
    "negative_duration.yaml": "negative_duration.yaml:3: server.shutdown_timeout: "
    "invalid duration -5: must not be negative",
    "negative_size.yaml": "negative_size.yaml:2: server.max_body_size: invalid size -1: "
    "must not be negative",
    "port_out_of_range.yaml": "port_out_of_range.yaml:2: server.listen: invalid listen address "
    "'0.0.0.0:65536': port out of range",
    "limit_status_below_400.yaml": "limit_status_below_400.yaml:11: limits.per_ip.status: "
    "must be at least 400, got 302",
    "limit_status_above_599.yaml": "limit_status_above_599.yaml:11: limits.per_ip.status: "
    "must be at most 599, got 600",
    "ipv6_prefix_zero.yaml": "ipv6_prefix_zero.yaml:1: ipv6_prefix: must be at least 1, got 0",
    "ipv6_prefix_over_128.yaml": "ipv6_prefix_over_128.yaml:3: ipv6_prefix: "
    "must be at most 128, got 129",
    "limit_missing_algorithm.yaml": "limit_missing_algorithm.yaml:8: limits.per_ip: "
    "algorithm is missing: give one of leaky_bucket, fixed_window, sliding_window, sliding_log, "
    "token_bucket, concurrency",
    "limit_zero_warmup.yaml": "limit_zero_warmup.yaml:8: limits.per_ip: "
    "warmup must be a positive number of seconds, got 0.0",
    "limit_window_under_1us.yaml": "limit_window_under_1us.yaml:8: limits.per_ip: "
    "window must be at least 1 microsecond, got 4e-07 s",
    "nonscalar_key.yaml": "nonscalar_key.yaml:3: server: mapping keys must be plain scalars",
    # tomllib (Python < 3.14) gives no line attribute: the line is read from its reason.
    "toml_syntax.toml": "toml_syntax.toml:3: invalid TOML: Invalid value (column 11)",
    "not_utf8.yaml": "not_utf8.yaml: not valid UTF-8",
    "limit_bad_name.yaml": "limit_bad_name.yaml:8: limits.per ip: invalid name 'per ip': use "
    "ASCII letters, digits, '_', '.' and '-', starting with a letter or digit",
    "upstream_port_out_of_range.yaml": "upstream_port_out_of_range.yaml:3: upstreams.backend.url: "
    "invalid upstream url 'http://127.0.0.1:99999': port out of range",
    "limit_empty_methods.yaml": "limit_empty_methods.yaml:11: limits.per_ip.match.methods: "
    "methods is empty: it would match no request (omit it for all)",
    "limit_empty_routes.yaml": "limit_empty_routes.yaml:12: limits.per_ip.match.routes: "
    "routes is empty: the limit would apply to no request (omit it for all)",
    "empty.yaml": "empty.yaml: routes: the policy routes nothing: every request would get 404; "
    "define at least one route (an empty or truncated file?)",
    "version_only.yaml": "version_only.yaml:1: routes: the policy routes nothing: every request "
    "would get 404; define at least one route (an empty or truncated file?)",
    "redis_limit_too_large.yaml": "redis_limit_too_large.yaml:10: limits.huge: 2 * limit + 1 "
    "(9.0072e+15) is too large for the Redis store: its Lua arithmetic is exact only below 2**53",
    "zero_header_timeout.yaml": "zero_header_timeout.yaml:2: server.header_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "zero_body_timeout.yaml": "zero_body_timeout.yaml:3: server.body_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "upgrade_h2c.yaml": "upgrade_h2c.yaml:3: server.upgrade_protocols: h2c cannot be proxied: "
    "an upgraded HTTP/2 connection would reach the upstream past every check and limit of the "
    "gateway",
    "zero_websocket_idle_timeout.yaml": "zero_websocket_idle_timeout.yaml:3: "
    "server.websocket_idle_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "zero_connect_timeout.yaml": "zero_connect_timeout.yaml:4: upstreams.backend.connect_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "zero_read_timeout.yaml": "zero_read_timeout.yaml:4: upstreams.backend.read_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "zero_idle_timeout.yaml": "zero_idle_timeout.yaml:4: upstreams.backend.idle_timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    "zero_store_timeout.yaml": "zero_store_timeout.yaml:3: store.timeout: "
    "must be longer than 0: a zero timeout would expire at once, every time",
    # PyYAML's and pydantic's own words (parser tokens, "Field required", "Input should be")
    # said in the policy's.
    # A secret (an internal service token) is never repeated: a failed reload logs the line.
    "exempt_header_value_not_a_list.yaml": "exempt_header_value_not_a_list.yaml:12: "
    "limits.per_ip.exempt_headers.X-Internal-Token: expected a list, got text (not shown: a "
    "secret)",
    # builtin:demo is an upstream's url, never a pool's server: not offered there.
    "pool_server_bad_url.yaml": "pool_server_bad_url.yaml:3: upstreams.backend.servers[1].url: "
    "invalid upstream url 'ftp://127.0.0.1:8001': expected http://host[:port][/path] or "
    "https://host[:port][/path]",
    "limit_cost_unknown_route.yaml": "limit_cost_unknown_route.yaml:14: "
    "limits.per_ip.cost.routes.serach: unknown route 'serach' (routes: search)",
    "limit_misspelt_algorithm.yaml": "limit_misspelt_algorithm.yaml:9: limits.per_ip.algoritm: "
    "unknown key: did you mean `algorithm`?",
    # Another algorithm's parameter: which one takes it, not the nearest spelling here.
    "token_bucket_nodelay.yaml": "token_bucket_nodelay.yaml:12: limits.per_ip.nodelay: a "
    "token_bucket does not take nodelay (leaky_bucket does); it rejects what it cannot admit "
    "(mode: reject) or waits for tokens (mode: queue)",
    "window_delay.yaml": "window_delay.yaml:12: limits.per_ip.delay: a sliding_window does not "
    "take delay (leaky_bucket does); it never delays: a request over the limit is rejected",
    "admin_token_too_short.yaml": "admin_token_too_short.yaml:2: server.admin_token: must be at "
    "least 16 characters long",
    "yaml_indentation.yaml": "yaml_indentation.yaml:4: invalid YAML: this line is indented 3 "
    "spaces, which lines up with no key above it: indent it as far as the key it belongs beside "
    "(the block from line 2 is indented 2)",
    "yaml_tab.yaml": "yaml_tab.yaml:3: invalid YAML: a tab character: YAML indents with spaces "
    "only",
    "limit_rate_as_limit.yaml": "limit_rate_as_limit.yaml:10: limits.login.limit: limit counts "
    "requests per window: write limit: 5, window: 1m (not '5/m')",
    "window_given_rate.yaml": "window_given_rate.yaml:10: limits.login.rate: a sliding_window "
    "takes limit and window, not rate (for 5r/m: limit: 5, window: 1m)",
    "bucket_given_window.yaml": "bucket_given_window.yaml:10: limits.per_ip.limit: a "
    "token_bucket takes rate and burst, not limit and window (for 10 per 1s: rate: 10r/s)",
    "upstream_url_list.yaml": "upstream_url_list.yaml:3: upstreams.backend.url: expected one "
    "URL, got a list",
    "limit_infinite_window.yaml": "limit_infinite_window.yaml:11: limits.per_ip.window: "
    "invalid duration inf: must be a finite number of seconds",
    "calendar_without_flag.yaml": "calendar_without_flag.yaml:8: limits.monthly: window 1mo is "
    "a calendar period: add calendar: true (and a timezone, UTC if none)",
    "calendar_seconds_window.yaml": "calendar_seconds_window.yaml:8: limits.monthly: a calendar "
    "window is 1d, 1w, 1mo or 1y, got a window of 2592000 s",
    "calendar_sliding.yaml": "calendar_sliding.yaml:8: limits.daily: a calendar window is a "
    "fixed window: use algorithm: fixed_window, not sliding_window",
    "calendar_unknown_zone.yaml": "calendar_unknown_zone.yaml:13: limits.daily.timezone: unknown "
    "time zone 'Europe/Berln': expected an IANA name like 'Europe/Berlin' or 'America/New_York' "
    "(where the system has no time zone database, install the tzdata package)",
    "calendar_period_unknown.yaml": "calendar_period_unknown.yaml:11: limits.quarterly.window: "
    "invalid window '3mo': a calendar window is 1d, 1w, 1mo or 1y (with calendar: true); other "
    "windows are Go durations like '90s', '15m', '720h'",
    "count_leaky_bucket.yaml": "count_leaky_bucket.yaml:8: limits.login: count charges after "
    "the response, which a leaky_bucket cannot: it delays each request by the state it finds; "
    "use a token_bucket in reject mode or a window algorithm",
    "count_override_warmup.yaml": "count_override_warmup.yaml:8: limits.metered: override "
    "'key-1': cost_header charges after the response, which a token_bucket with warmup cannot: "
    "its ramp is computed per request; remove warmup",
    "count_token_bucket_queue.yaml": "count_token_bucket_queue.yaml:8: limits.metered: "
    "cost_header charges after the response, which a token_bucket in queue mode cannot: a limit "
    "charged after the response never delays; use mode: reject",
    "count_bad_status.yaml": "count_bad_status.yaml:13: limits.failures.count.statuses[1]: "
    "invalid status '6xx': expected a status code from 100 to 599 (401) or a class ('5xx')",
    "count_as_list.yaml": "count_as_list.yaml:12: limits.failures.count: expected a mapping, "
    "got a list: write count: {statuses: [401]}",
    "count_leased.yaml": "count_leased.yaml:8: limits.failures: count charges after the "
    "response, which a leased limit cannot: a lease is a batch of admissions taken ahead; "
    "remove lease",
    "hold_without_count.yaml": "hold_without_count.yaml:8: limits.per_ip: hold applies to a "
    "limit charged after the response (count, cost_header or cost_from): a limit charged at "
    "admission holds its cost already; remove hold",
    "cost_from_bad_path.yaml": "cost_from_bad_path.yaml:12: limits.tokens.cost_from: cost_from "
    "'usage.total_tokens * 2': 'usage.total_tokens * 2' is not a path; write a preset (openai, "
    "anthropic), a dotted path (usage.total_tokens) or a sum of them (usage.prompt_tokens + "
    "usage.completion_tokens)",
    "cost_from_and_cost_header.yaml": "cost_from_and_cost_header.yaml:8: limits.tokens: "
    "cost_from and cost_header both say what a response cost: keep one of them",
    "reserve_with_hold_none.yaml": "reserve_with_hold_none.yaml:8: limits.tokens: reserve is "
    "what a request holds while in flight, and hold: none holds nothing; remove one of them",
    "reserve_without_charge.yaml": "reserve_without_charge.yaml:8: limits.tokens: reserve "
    "applies to a limit charged after the response (cost_from, cost_header or count): a limit "
    "charged at admission takes its cost; remove reserve, or use cost",
    "body_key_bad_path.yaml": "body_key_bad_path.yaml:12: limits.per_model.key: invalid key "
    "part 'body:model..name': expected client_ip, header:NAME, query:NAME, route, method, "
    "global, const:TEXT, plan:LIMIT, jwt:CLAIM or body:FIELD (a JSON field of the request "
    "body: model, metadata.user)",
    "hold_unknown.yaml": "hold_unknown.yaml:13: limits.failed_logins.hold: expected "
    "'in_flight' or 'none', got 'always'",
    "cost_header_framing.yaml": "cost_header_framing.yaml:12: limits.metered.cost_header: "
    "Content-Length frames the response, it cannot be a cost header (removing it would break "
    "the response)",
    # `header: X-Api-Key` in a flow list is a mapping to YAML: say how to write it.
    "key_part_as_mapping.yaml": "key_part_as_mapping.yaml:12: limits.per_key.key[0]: expected "
    "text, got a mapping: a space after a colon makes one in YAML; write header:X-Api-Key with "
    "no space, or quote it ('header:X-Api-Key')",
    "listen_is_admin_listen.yaml": "listen_is_admin_listen.yaml:1: server: listen (0.0.0.0:9090) "
    "and admin_listen (127.0.0.1:9090) take the same port: give the admin listener a port of "
    "its own",
    "concurrency_cost_over_limit.yaml": "concurrency_cost_over_limit.yaml:8: limits.per_client: "
    "cost (3) exceeds limit (2): a request needing more slots than the limit has could never "
    "be admitted",
    "concurrency_route_cost_over_limit.yaml": "concurrency_route_cost_over_limit.yaml:8: "
    "limits.per_client: cost.routes.api (5) exceeds limit (4): a request needing more slots "
    "than the limit has could never be admitted",
    "concurrency_plan_under_cost.yaml": "concurrency_plan_under_cost.yaml:8: limits.per_client: "
    "plan 'small': cost (2) exceeds limit (1): a request needing more slots than the limit has "
    "could never be admitted",
    "concurrency_leased.yaml": "concurrency_leased.yaml:8: limits.per_client: concurrency "
    "cannot be leased: a slot is given back when its request ends, and a batch of slots taken "
    "ahead would be held by nobody",
    # A concurrency limit counts requests in flight, not over time: no window to convert to.
    "concurrency_given_rate.yaml": "concurrency_given_rate.yaml:10: limits.per_client.rate: a "
    "concurrency takes limit (requests in flight at once per key), not rate: for 10r/s use a "
    "leaky_bucket or token_bucket (rate: 10r/s), or a fixed_window (limit: 10, window: 1s)",
    "worker_lease_on_redis.yaml": "worker_lease_on_redis.yaml:7: store: worker_lease leases "
    "between the workers of the shared store (url: shared or memory); on Redis, lease a limit's "
    "quota between replicas with its lease:",
    "concurrency_zero_limit.yaml": "concurrency_zero_limit.yaml:10: limits.per_client.limit: "
    "must be at least 1, got 0",
    "adaptive_min_over_max.yaml": "adaptive_min_over_max.yaml:4: upstreams.backend.adaptive: "
    "min_limit (10) cannot exceed max_limit (5)",
    "adaptive_initial_limit_below_min.yaml": "adaptive_initial_limit_below_min.yaml:4: "
    "upstreams.backend.adaptive: initial_limit (2) must be between min_limit (5) and max_limit "
    "(100)",
    "adaptive_zero_buffer.yaml": "adaptive_zero_buffer.yaml:5: upstreams.backend.adaptive.buffer: "
    "must be above 0, got 0",
    "adaptive_zero_sample_interval.yaml": "adaptive_zero_sample_interval.yaml:5: "
    "upstreams.backend.adaptive.sample_interval: must be longer than 0: the limit would be "
    "measured without pause",
    "adaptive_jitter_over_1.yaml": "adaptive_jitter_over_1.yaml:5: "
    "upstreams.backend.adaptive.jitter: must be at most 1, got 1.5",
    "adaptive_misspelt_key.yaml": "adaptive_misspelt_key.yaml:5: "
    "upstreams.backend.adaptive.min_limt: unknown key: did you mean `min_limit`?",
}


def test_every_invalid_fixture_has_an_expectation() -> None:
    assert sorted(p.name for p in INVALID.iterdir()) == sorted(EXPECTED_ERRORS)


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_invalid_fixture_exact_message(name: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_and_build(INVALID / name)
    expected = EXPECTED_ERRORS[name].split(":", 1)[1].replace("{dir}", str(INVALID))
    assert str(info.value) == f"{INVALID / name}:{expected}"


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "valid").iterdir()))
def test_valid_fixtures_load(name: str) -> None:
    loaded = load_and_build(FIXTURES / "valid" / name)
    assert len(loaded.sha256) == 64
    assert loaded.policy.routes


def test_toml_values_are_parsed_like_yaml() -> None:
    policy = load_and_build(FIXTURES / "valid" / "minimal.toml").policy
    assert policy.upstreams["backend"].read_timeout == 5.0
    assert policy.routes[0].match.methods == ("GET", "POST")
    assert policy.server.trusted_proxies == ("10.0.0.0/8",)


def test_several_problems_are_all_reported() -> None:
    text = "server:\n  workers: 0\n  listen: nowhere\n"
    with pytest.raises(PolicyError) as info:
        parse_and_build(text, "p.yaml")
    lines = str(info.value).splitlines()
    assert lines == [
        "p.yaml:3: server.listen: invalid listen address 'nowhere': "
        "expected HOST:PORT, e.g. 0.0.0.0:8080",
        "p.yaml:2: server.workers: must be at least 1, got 0",
    ] or lines == [
        "p.yaml:2: server.workers: must be at least 1, got 0",
        "p.yaml:3: server.listen: invalid listen address 'nowhere': "
        "expected HOST:PORT, e.g. 0.0.0.0:8080",
    ]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("listen", "admin_listen", "collide"),
    [
        ("127.0.0.1:9090", "127.0.0.1:9090", True),
        ("0.0.0.0:9090", "127.0.0.1:9090", True),  # SO_REUSEPORT would let both bind
        ("10.0.0.1:9090", "0.0.0.0:9090", True),
        ("[::]:9090", "[::1]:9090", True),
        ("LOCALHOST:9090", "localhost:9090", True),
        ("127.0.0.1:9090", "127.0.0.2:9090", False),
        ("[::]:9090", "127.0.0.1:9090", False),  # another family: IPV6_V6ONLY, as asyncio binds
        ("127.0.0.1:8080", "127.0.0.1:9090", False),
        ("127.0.0.1:0", "127.0.0.1:0", False),  # each gets a port of its own
    ],
)
def test_listen_and_admin_listen_on_one_port_are_refused(
    listen: str, admin_listen: str, collide: bool
) -> None:
    text = (
        f"server:\n  listen: '{listen}'\n  admin_listen: '{admin_listen}'\n"
        "upstreams:\n  b:\n    url: http://127.0.0.1:9\nroutes:\n  - name: all\n    upstream: b\n"
    )
    if not collide:
        parse_and_build(text, "p.yaml")
        return
    with pytest.raises(PolicyError) as info:
        parse_and_build(text, "p.yaml")
    assert str(info.value) == (
        f"p.yaml:1: server: listen ({listen}) and admin_listen ({admin_listen}) take the same "
        "port: give the admin listener a port of its own"
    )


def test_policy_is_frozen() -> None:
    policy = load_and_build(FIXTURES / "valid" / "default.yaml").policy
    with pytest.raises(ValueError):
        policy.server.workers = 3  # type: ignore[misc]


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_check_valid_exits_zero() -> None:
    result = _gateway("check", str(FIXTURES / "valid" / "default.yaml"))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_cli_check_invalid_exits_one_with_file_line_reason() -> None:
    path = INVALID / "unknown_upstream.yaml"
    result = _gateway("check", str(path))
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"{path}:{EXPECTED_ERRORS['unknown_upstream.yaml'].split(':', 1)[1]}"
    )


def test_cli_schema_matches_committed_file() -> None:
    result = _gateway("schema")
    assert result.returncode == 0
    committed = (Path(__file__).parent.parent / "policies" / "policy.schema.json").read_text()
    assert result.stdout == committed, "run `gateway schema > policies/policy.schema.json`"


def test_an_unclosed_quote_names_where_it_opened() -> None:
    text = 'upstreams:\n  backend:\n    url: "http://127.0.0.1:8000\nroutes: []\n'
    with pytest.raises(PolicyError) as info:
        parse_and_build(text, "p.yaml")
    assert str(info.value) == (
        "p.yaml:5: invalid YAML: found unexpected end of stream "
        "(while scanning a quoted scalar that starts on line 3)"
    )


def test_a_bare_number_is_a_duration_in_seconds_as_in_nginx() -> None:
    """Documented beside the Go syntax: ``connect_timeout: 5`` is five seconds, not 5 ms."""
    text = (
        "upstreams:\n  backend:\n    url: http://127.0.0.1:8000\n    connect_timeout: 5\n"
        "    read_timeout: 0.5\nroutes:\n  - name: all\n    upstream: backend\n"
    )
    upstream = parse_and_build(text, "p.yaml").policy.upstreams["backend"]
    assert (upstream.connect_timeout, upstream.read_timeout) == (5.0, 0.5)


@pytest.mark.reliability
def test_the_advice_for_a_rate_on_a_concurrency_limit_is_accepted() -> None:
    """What the line says to write instead of ``rate:`` on a concurrency limit, written as
    it says, is a policy ``check`` accepts (the probe: it advised ``window:``, which a
    concurrency limit refuses)."""
    text = (FIXTURES / "invalid" / "concurrency_given_rate.yaml").read_text()
    with pytest.raises(PolicyError) as info:
        parse_and_build(text, "p.yaml")
    message = str(info.value)
    advice = re.findall(r"(\w+) \((\w+: [^)]*)\)", message)
    assert advice, message
    for algorithm, params in advice:
        lines = "".join(f"    {param.strip()}\n" for param in params.split(","))
        fixed = re.sub(
            r"    algorithm: concurrency\n    rate: 10r/s\n",
            f"    algorithm: {algorithm}\n{lines}",
            text,
        )
        parse_and_build(fixed, "p.yaml")  # accepted
