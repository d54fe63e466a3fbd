"""One worker process: its parts built in one pass (``lifecycle.Gateway``), the runtime snapshot a
reload swaps, the heap settings while serving, and the built-in demo backend."""
