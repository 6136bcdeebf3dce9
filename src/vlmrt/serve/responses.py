"""The answer objects: a chat.completion, the chat.completion.chunk events of a stream, usage, and the `vlmrt` field
(timings: queue wait, time to first token, prefill and decode tokens/s, prompt tokens reused from the slot's cache)."""

from __future__ import annotations

import json
import time
import uuid

from .scheduler import Finished

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(f: Finished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.stats["reused_prompt_tokens"]}}


def timings(f: Finished) -> dict:
    s = f.stats
    return {"slot": f.slot, "queue_s": round(f.queue_s, 4), "ttft_s": round(s["ttft_s"], 4),
            "preprocess_s": round(s["preprocess_s"], 4), "vision_s": round(s["vision_s"], 4),
            "prefill_tokens_per_s": round(s["prefill_tokens_per_s"], 1),
            "decode_tokens_per_s": round(s["decode_tokens_per_s"], 1), "total_s": round(s["total_s"], 4),
            "prompt_tokens": f.prompt_tokens, "reused_prompt_tokens": s["reused_prompt_tokens"],
            "images": s["images"], "images_cached": s["images_cached"], "stop_reason": f.stop_reason,
            "drafted_tokens": s["drafted_tokens"], "accepted_tokens": s["accepted_tokens"]}


def completion(cid: str, model: str, f: Finished) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f.text},
                         "finish_reason": FINISH.get(f.stop_reason, "stop"), "logprobs": None}],
            "usage": usage(f), "vlmrt": timings(f)}


def chunk(cid: str, model: str, delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    """One server-sent event; delta None = no choices (the usage chunk)."""
    obj = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
           **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def chat_stream(events, cid: str, model: str, include_usage: bool):
    """The chat.completion.chunk events of a stream, from app._events' (kind, value) pairs."""
    extra = {"usage": None} if include_usage else {}
    yield chunk(cid, model, {"role": "assistant", "content": ""}, **extra)
    async for kind, value in events:
        if kind == "piece":
            yield chunk(cid, model, {"content": value}, **extra)
        elif kind == "done":
            yield chunk(cid, model, {}, FINISH.get(value.stop_reason, "stop"), vlmrt=timings(value), **extra)
            if include_usage:
                yield chunk(cid, model, None, usage=usage(value))
            yield DONE
        else:  # an error after the first piece: the stream has begun, so the error is an event
            yield b"data: " + json.dumps(value.body()).encode() + b"\n\n"
