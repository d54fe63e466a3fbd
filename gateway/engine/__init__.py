"""The limit engine: which limits and keys apply to a request, one verdict from the store, the
rate-limit headers, and the shaping queue a delayed request waits in."""
