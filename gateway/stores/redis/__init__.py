"""Limit state in Redis, shared by every gateway replica: one atomic script call per request.

All limits of a request are decided by ONE call of one Lua script (``lua/`` here: a file per
algorithm mirroring its Python module, plus ``decide.lua`` which checks every limit, then commits
all or none). The script reads the clock from Redis ``TIME``, so replicas whose own clocks
disagree still share one timeline. Script calls of requests that arrive together go out as one
pipeline (each still its own atomic call), with at most ``max_in_flight`` pipelines outstanding.

Keys are ``{prefix}{{tag}}{limit}:{fingerprint}:{key}``. The fingerprint hashes the limit's
algorithm and key parts, so a reload that changes either starts the limit afresh. A key's value
is the parameters it was written under, then the state: a reload that changes only parameters
(rate, burst, limit, window) keeps the keys, and the script rescales a state written under
other parameters as the Python algorithm's ``rescale`` does, the first time it meets it, and
writes it back rescaled. So replicas that reload at different moments never read a state as if
written under their own parameters. Every key expires when its state has decayed to what an
absent key means, so idle keys vanish. The hash tag puts all keys one request touches in one
cluster slot: when every limit's key shares a part (say ``client_ip``), that part's value is
the tag and clients spread over the cluster; otherwise (a ``global`` limit stacked on
per-client ones, for instance) every key carries the same tag and lives on one node.

When Redis fails or is slow (``timeout_s`` per call), ``on_failure`` says what to do: ``local``
decides in an in-process ``MemoryStore`` with each limit divided by ``replicas``, ``allow``
admits, ``deny`` raises ``StoreUnavailableError`` (the engine answers 503). A circuit breaker
per node (a cluster's masters: a dead one makes only its own keys fall back) stops trying after
a few failures in a row and probes again later. ``stats.state`` says what answers: ``ok``
(Redis), ``fallback`` (a call failed, the circuit is still closed), ``open`` or ``half_open``
(the worst node's circuit; ``on_failure`` answers meanwhile); each change is logged once.
"""

from gateway.stores.redis.store import RedisStore

__all__ = ["RedisStore"]
