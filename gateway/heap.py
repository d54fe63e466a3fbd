"""Keep the garbage collector's full passes off the request path's timeline."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move everything alive once a worker is serving (modules, the policy, the app) out of the
    collector's reach: a full collection otherwise walks all of it, tens of thousands of objects
    that never become garbage, holding the loop for tens of milliseconds every few seconds under
    load. Objects made later (requests, a reloaded policy) are collected as before."""
    gc.collect()
    gc.freeze()


def refreeze_heap() -> None:
    """After a reload's old runtime is retired: what was frozen with it (its tables, pools,
    limits) is garbage the collector can no longer reach. Thaw, collect once, freeze again: one
    full pass per reload instead of a leak per reload. Nothing to do where nothing was frozen
    (a gateway started inside another program, or tests)."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()
