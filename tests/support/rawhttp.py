"""A raw-socket HTTP client for tests that must send exactly the bytes they mean."""

from __future__ import annotations

import asyncio


async def exchange(
    port: int, data: bytes, *, read_for: float = 5.0, host: str = "127.0.0.1"
) -> bytes:
    """Send ``data``, half-close, and read until the server closes or ``read_for`` seconds pass."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + read_for
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), remaining)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    """Status code of the first response in ``response`` (0 if there is none)."""
    if not response.startswith(b"HTTP/1."):
        return 0
    return int(response.split(b" ", 2)[1])


def split_head(response: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    headers = []
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    return headers, body
