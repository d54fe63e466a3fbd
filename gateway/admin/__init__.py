"""The admin listener (``/healthz``, ``/readyz``, ``/policy``, ``/reload``, ``/explain``), its
token and cookie, and the ``healthcheck`` probe of it."""
