"""Keep the garbage collector's passes off the request path's timeline."""

from __future__ import annotations

import gc
from typing import Final

# Net allocations of tracked objects between two young collections while serving (CPython's
# default is 700). The count the collector keeps is allocations minus deallocations, floored at
# zero after each collection: the objects of requests in flight when a collection runs are freed
# later without counting down, so under load the count climbs by the in-flight churn alone and
# the default triggers hundreds of young collections a second that find nothing (every request's
# objects die by reference counting), each one a walk of every live young object, and every
# tenth of those a walk of the older generation. Real cyclic garbage still triggers a
# collection after this many objects.
SERVING_YOUNG_THRESHOLD: Final = 100_000


def freeze_startup_heap() -> None:
    """Move everything alive once a worker is serving (modules, the policy, the app) out of the
    collector's reach: a full collection otherwise walks all of it, tens of thousands of objects
    that never become garbage, holding the loop for tens of milliseconds every few seconds under
    load. Objects made later (requests, a reloaded policy) are collected as before, but only
    after ``SERVING_YOUNG_THRESHOLD`` net allocations."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(SERVING_YOUNG_THRESHOLD, older, oldest)


def refreeze_heap() -> None:
    """After a reload's old runtime is retired: what was frozen with it (its tables, pools,
    limits) is garbage the collector can no longer reach. Thaw, collect once, freeze again: one
    full pass per reload instead of a leak per reload. Nothing to do where nothing was frozen
    (a gateway started inside another program, or tests)."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()
