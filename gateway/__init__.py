"""A rate-limiting reverse proxy on aiohttp."""

__version__ = "0.1.0"
