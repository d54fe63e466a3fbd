"""Compiled limits: which routes and limits match a request, the key a limit counts by, and the
check a store decides (data the stores and the engine share, below both)."""
