"""Prometheus metrics, the live dashboard and the access log, for the whole gateway.

``observer.Observability(gateway)`` is one worker's share: ``wrap`` the proxy handler to count
requests, ``install`` ``/metrics`` and ``/dashboard`` on the admin app. The proxy leaves what it
learns on each request under the keys of ``hooks``; a limit store reports its calls and circuit
state through a ``stats.StoreStats``. This module imports nothing, so the proxy and the stores
can import those two small modules without pulling in the rest.
"""
