"""Fixtures for every test file, each defined beside the harness it belongs to: recording and
slow upstreams, an in-process gateway, gateway processes, a browser, the store conformance
backends. (The Redis servers are imported per module: see ``support/redis_harness.py``.)"""

pytest_plugins = (
    "tests.support.browser",
    "tests.support.conformance",
    "tests.support.gateways",
    "tests.support.held_upstream",
    "tests.support.llm_upstream",
    "tests.support.processes",
    "tests.support.upstreams",
)
