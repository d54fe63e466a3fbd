"""A test upstream that speaks enough of the OpenAI-compatible API (``POST
/v1/chat/completions``, with and without ``stream``) and of Anthropic's (``POST /v1/messages``)
for the official clients, with usage the tests can predict:

- prompt (input) tokens: the words of the request's messages;
- completion (output) tokens: the request's ``max_tokens`` (``max_completion_tokens``), or 16;
  the answer is that many words, one per stream event;
- ``usage: "missing"`` or ``"malformed"`` in the request body (an extra field the clients pass
  through ``extra_body``): the usage is left out, or is not a number;
- a stream reports its usage in its last event before ``[DONE]`` only when asked
  (``stream_options: {include_usage: true}``), as OpenAI does; Anthropic's always (its
  ``message_start`` and ``message_delta`` events).

``hold`` (an ``asyncio.Event``): when set to a new event, every answer waits for it (for
counting calls in flight). ``stall: true`` in the request body: a stream stops after its
first two events until ``stall`` (an event) is set, so a client can leave in the middle.
``pad_bytes: N`` in a streamed chat request's body: at least N bytes more of text events (not
counted in the usage) before the last, written 64 KiB at a time (a long stream, quickly).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer


@dataclass
class LlmUpstream:
    port: int = 0
    calls: int = 0
    in_flight: int = 0
    # The total tokens each answer reported (what the gateway should have charged).
    reported: list[int] = field(default_factory=list)
    hold: asyncio.Event | None = None
    stall: asyncio.Event = field(default_factory=asyncio.Event)
    # Streams stalled in the middle (``stall: true``), waiting for ``stall``.
    stalled: int = 0

    async def pause(self, body: dict[str, Any], sent: int) -> None:
        if body.get("stall") and sent == 2:
            self.stalled += 1
            await self.stall.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _words(messages: Any) -> int:
    count = 0
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            count += len(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    count += len(part["text"].split())
    return count


def _usage(body: dict[str, Any], prompt: int, completion: int, anthropic: bool) -> Any:
    mode = body.get("usage")
    if mode == "missing":
        return None
    if mode == "malformed":
        return {"total_tokens": "lots", "input_tokens": "lots", "output_tokens": None}
    if anthropic:
        return {"input_tokens": prompt, "output_tokens": completion}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _text_events(base: dict[str, Any], include_usage: bool) -> bytes:
    """About 64 KiB of whole text events, written as one block."""
    chunk: dict[str, Any] = {
        **base,
        "choices": [{"index": 0, "delta": {"content": "pad "}, "finish_reason": None}],
    }
    if include_usage:
        chunk["usage"] = None
    event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return event * (65536 // len(event))


async def _chat(upstream: LlmUpstream, request: web.BaseRequest) -> web.StreamResponse:
    body = json.loads(await request.read())
    prompt = _words(body.get("messages"))
    completion = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    usage = _usage(body, prompt, completion, anthropic=False)
    if usage is not None and body.get("usage") is None:
        upstream.reported.append(prompt + completion)
    model = body.get("model", "test-model")
    if not body.get("stream"):
        answer = {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ".join(["word"] * completion)},
                    "finish_reason": "length",
                }
            ],
        }
        if usage is not None:
            answer["usage"] = usage
        return web.json_response(answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def event(data: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")

    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1}
    base["model"] = model
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    for index in range(completion):
        await upstream.pause(body, index)
        delta = {"content": "word "} if index else {"role": "assistant", "content": "word "}
        chunk: dict[str, Any] = {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        if include_usage:
            chunk["usage"] = None
        await event(chunk)
    pad = int(body.get("pad_bytes") or 0)
    if pad:
        block = _text_events(base, include_usage)
        for _ in range(-(-pad // len(block))):
            await response.write(block)
    last: dict[str, Any] = {
        **base,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
    }
    if include_usage:
        last["usage"] = None
    await event(last)
    if include_usage:
        await event({**base, "choices": [], "usage": usage})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _messages(upstream: LlmUpstream, request: web.BaseRequest) -> web.StreamResponse:
    body = json.loads(await request.read())
    prompt = _words(body.get("messages"))
    completion = int(body.get("max_tokens") or 16)
    usage = _usage(body, prompt, completion, anthropic=True)
    if usage is not None and body.get("usage") is None:
        upstream.reported.append(prompt + completion)
    model = body.get("model", "test-model")
    message = {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": model,
        "stop_reason": "max_tokens",
        "stop_sequence": None,
    }
    if not body.get("stream"):
        answer = {**message, "content": [{"type": "text", "text": " ".join(["word"] * completion)}]}
        if usage is not None:
            answer["usage"] = usage
        return web.json_response(answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def event(kind: str, data: dict[str, Any]) -> None:
        payload = json.dumps({"type": kind, **data}).encode()
        await response.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

    start_usage = {"input_tokens": prompt, "output_tokens": 1} if usage is not None else None
    await event("message_start", {"message": {**message, "content": [], "usage": start_usage}})
    await event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    for index in range(completion):
        await upstream.pause(body, index)
        await event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "word "}}
        )
    await event("content_block_stop", {"index": 0})
    delta: dict[str, Any] = {"delta": {"stop_reason": "max_tokens", "stop_sequence": None}}
    if usage is not None:
        delta["usage"] = {"output_tokens": completion}
    await event("message_delta", delta)
    await event("message_stop", {})
    await response.write_eof()
    return response


@pytest.fixture
async def llm_upstream() -> AsyncIterator[LlmUpstream]:
    upstream = LlmUpstream()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        upstream.calls += 1
        upstream.in_flight += 1
        try:
            if upstream.hold is not None:
                await upstream.hold.wait()
            if request.method == "POST" and request.path == "/v1/chat/completions":
                return await _chat(upstream, request)
            if request.method == "POST" and request.path == "/v1/messages":
                return await _messages(upstream, request)
            return web.json_response({"error": {"message": "not found"}}, status=404)
        finally:
            upstream.in_flight -= 1

    server = RawTestServer(handle, host="127.0.0.1")
    await server.start_server()
    assert server.port is not None
    upstream.port = server.port
    yield upstream
    upstream.stall.set()
    if upstream.hold is not None:
        upstream.hold.set()
    await server.close()
