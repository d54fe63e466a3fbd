"""The policy: its schema (pydantic models, the one source of the file format), units, loading
with file:line errors, overrides, what ``check`` and ``run`` build before serving, and reloads."""
