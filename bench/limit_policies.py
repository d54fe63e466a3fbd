"""The policies of issue 11's comparison: no limits, one never-binding limit, three stacked
never-binding limits (in process, or in Redis); and those three with a never-binding
concurrency limit stacked on them, or no limits and the upstream's adaptive limit (a healthy
upstream: what the gate costs). Shared by ``bench_proxy.py`` and ``bench_request_path.py`` so
both measure the same limits."""

from __future__ import annotations

NO_LIMITS = "none"
ONE_LIMIT = "1limit"
THREE_LIMITS = "3limits"
THREE_AND_CONCURRENCY = "3limits+concurrency"
ADAPTIVE = "adaptive"

_HEAD = """\
version: 1
upstreams:
  backend:
    url: {upstream}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    upstream: backend
  - name: default
    upstream: backend
"""

_STORE = """\
store:
  url: {redis}
  on_failure: local
"""

_ONE = """\
limits:
  per_ip:
    algorithm: leaky_bucket
    rate: 1000000r/s
    burst: 100000
    nodelay: true
    key: [client_ip]
"""

_THREE = (
    _ONE
    + """\
  per_route:
    algorithm: sliding_window
    limit: 100000000
    window: 1s
    key: [route]
  global:
    algorithm: token_bucket
    rate: 1000000r/s
    burst: 1000000
    key: [global]
"""
)


_CONCURRENCY = """\
  in_flight:
    algorithm: concurrency
    limit: 1000000
    key: [client_ip]
"""

# Requests beyond the limit wait for a place (max_delay) rather than get 503 at once: wrk's
# connections are more than the limit starts from, and the benchmark measures the gate, not
# what it sheds while it finds the level.
_ADAPTIVE = """\
    adaptive: {max_delay: 5s}
"""


def policy_text(kind: str, upstream: str, redis: str | None = None) -> str:
    """The policy file for ``kind`` (``NO_LIMITS``, ``ONE_LIMIT``, ``THREE_LIMITS``)."""
    text = _HEAD.format(upstream=upstream)
    if redis is not None:
        text += _STORE.format(redis=redis)
    if kind == ONE_LIMIT:
        text += _ONE
    elif kind == THREE_LIMITS:
        text += _THREE
    elif kind == THREE_AND_CONCURRENCY:
        text += _THREE + _CONCURRENCY
    elif kind == ADAPTIVE:
        text = text.replace(f"    url: {upstream}\n", f"    url: {upstream}\n{_ADAPTIVE}")
    elif kind != NO_LIMITS:
        raise ValueError(f"unknown policy kind {kind!r}")
    return text
