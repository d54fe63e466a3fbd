"""Prometheus metrics, the live dashboard and the access log, for the whole gateway.

``observer.Observability(state)`` is one worker's share, reading only the parts a
``worker.WorkerState`` names: ``wrap`` the proxy handler to count requests;
``dashboard.install`` puts ``/metrics`` and ``/dashboard`` on the admin app. The proxy leaves
what it learns on each request under the keys of ``hooks``; a limit store reports its calls and
circuit state through a ``stats.StoreStats``. This module imports nothing, so the proxy and the
stores can import those two small modules without pulling in the rest.
"""
