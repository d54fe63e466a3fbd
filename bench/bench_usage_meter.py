"""What reading a stream's usage costs the relay: a streamed completion of 1,000 events (an
OpenAI-compatible stream asked for its usage, and an Anthropic-style one) fed to a
``UsageMeter`` as the relay feeds it, one chunk per event, then in 16 KiB chunks.

    python bench/bench_usage_meter.py

Prints the CPU time per stream (best of several rounds): the meter's whole cost, to set
beside what relaying the same stream costs the gateway (bench/README.md).
"""

from __future__ import annotations

import json
import time

from gateway.limits.usage import UsageMeter, UsageSource

EVENTS = 1000


def openai_stream() -> list[bytes]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        b"data: "
        + json.dumps(
            {**base, "choices": [{"index": 0, "delta": {"content": "word "}}], "usage": None}
        ).encode()
        + b"\n\n"
        for _ in range(EVENTS)
    ]
    usage = {"prompt_tokens": 10, "completion_tokens": EVENTS, "total_tokens": EVENTS + 10}
    events.append(
        b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
    )
    events.append(b"data: [DONE]\n\n")
    return events


def anthropic_stream() -> list[bytes]:
    def event(kind: str, data: dict[str, object]) -> bytes:
        payload = json.dumps({"type": kind, **data}).encode()
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    events = [event("message_start", {"message": {"usage": {"input_tokens": 10}}})]
    delta = {"index": 0, "delta": {"type": "text_delta", "text": "word "}}
    events += [event("content_block_delta", delta) for _ in range(EVENTS)]
    events.append(event("message_delta", {"usage": {"output_tokens": EVENTS}}))
    return events


def per_stream_us(source: str, chunks: list[bytes], rounds: int = 7, streams: int = 20) -> float:
    best = float("inf")
    sources = [UsageSource(source)]
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(streams):
            meter = UsageMeter(sources, stream=True)
            for chunk in chunks:
                meter.feed(chunk)
            meter.finish()
        best = min(best, (time.process_time() - started) / streams)
    assert meter.readings()[0][1] == EVENTS + 10
    return best * 1e6


def main() -> None:
    for name, source, events in (
        ("openai", "openai", openai_stream()),
        ("anthropic", "anthropic", anthropic_stream()),
    ):
        whole = b"".join(events)
        big = [whole[i : i + 16384] for i in range(0, len(whole), 16384)]
        print(
            f"{name}: {len(whole) / 1024:.0f} KiB, {len(events)} events: "
            f"{per_stream_us(source, events):.0f} us per stream fed an event at a time, "
            f"{per_stream_us(source, big):.0f} us in 16 KiB chunks"
        )


if __name__ == "__main__":
    main()
