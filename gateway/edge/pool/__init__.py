"""Upstream pools: several servers behind one upstream name, balanced and health-checked.

``balancers`` picks a server, ``passive_health`` (nginx's ``max_fails``/``fail_timeout``),
``outliers`` (Envoy's outlier ejection) and ``active_health`` judge them, all pure and handed
``now``; ``server_pool`` ties them to each server's keep-alive connections, and ``dns`` resolves
host names again as a headless service's pods come and go.
"""
