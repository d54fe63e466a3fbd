"""The rate-limit algorithms: pure, one module each (``base.Algorithm`` is their protocol).

Adding an algorithm touches these places, in this order:

1. ``gateway/algorithms/<name>.py``: the class, implementing every method of
   ``base.Algorithm`` (``decide``, ``is_idle``, ``refund``, ``rescale``, ``share`` for the
   Redis store's per-replica fallback) with frozen parameters, ``__eq__``/``__hash__`` by
   parameters (a reload keeps a limit's state while its algorithm is equal), and as public
   properties whatever the Lua mirror needs; mypy checks the protocol where it is built.
2. ``gateway/policy/limit_models.py``: its limit model (an ``algorithm`` literal,
   ``extra="forbid"``) in the ``Limit`` union, with a ``window_s`` property: its advertised
   window (``w`` of the ``RateLimit-Policy`` header).
3. ``gateway/algorithms/registry.py``: ``build_algorithm`` maps the model to the class.
4. ``gateway/stores/redis/lua/<name>.lua``: the Lua mirror (``MAKE[letter]``), listed in
   ``stores/redis/store.py``'s script files; ``stores/redis/codecs.py``: a codec packing its
   parameters behind that letter and turning the script's reply into a ``Decision``, picked in
   ``codec_for``.
5. Tests: ``tests/test_<name>.py`` on a fake clock (Hypothesis for its invariants), and the
   ``ALGORITHMS`` table of ``tests/support/conformance.py``, whose tests run each entry over
   every store and check the Lua mirror against the Python class.

The dashboard and the metrics show only the algorithm's ``name``: nothing to add there.

``concurrency.py`` is one of them (slots held, given back by ``refund``); ``gradient_limit.py``
is not: it is the controller behind an upstream's ``adaptive:`` limit, one per upstream, with
an API of its own (``try_acquire``/``release``).
"""
