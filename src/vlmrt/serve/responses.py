"""The answer objects: a chat.completion, the chat.completion.chunk events of a stream, usage, and the `vlmrt` field
(timings: queue wait, time to first token, prefill and decode tokens/s, prompt tokens reused from the slot's cache);
with tools, the answer's tool calls read back (ToolReader: the checkpoint's format, runtime/prompt/tool_calls.py) as
`tool_calls` and finish_reason "tool_calls", streamed as OpenAI streams them; with logprobs, choices[0].logprobs
{"content": [{token, logprob, bytes, top_logprobs}, ...]}, streamed with the chunks whose text the tokens brought."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..runtime.prompt.tool_calls import ToolFormat, held_from
from .scheduler import Finished

FINISH = {"eos": "stop", "stop": "stop", "grammar": "stop", "length": "length", "context": "length"}


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


@dataclass(frozen=True)
class ToolReader:
    """How to read an answer's tool calls: the checkpoint's format and the functions given ({name: parameters})."""

    fmt: ToolFormat
    functions: dict

    def read(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls as OpenAI's tool_calls: id, type, function name and arguments as a JSON string)."""
        content, calls = self.fmt.parse(text, self.functions)
        return content, [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                         for c in calls]


def _logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion(cid: str, model: str, f: Finished, tools: ToolReader | None = None) -> dict:
    message, finish = {"role": "assistant", "content": f.text}, FINISH.get(f.stop_reason, "stop")
    if tools is not None:
        content, calls = tools.read(f.text)
        if calls:
            message = {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}
            finish = "tool_calls"
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": _logprobs(f.logprobs)}],
            "usage": usage(f), "vlmrt": timings(f)}


def chunk(cid: str, model: str, delta: dict | None = None, finish: str | None = None,
          logprobs: list[dict] | None = None, **extra) -> bytes:
    """One server-sent event; delta None = no choices (the usage chunk); logprobs: the entries of the tokens whose text
    it brings (None: not asked for)."""
    obj = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                 "logprobs": _logprobs(logprobs)}],
           **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def chat_stream(events, cid: str, model: str, include_usage: bool, tools: ToolReader | None = None,
                      logprobs: bool = False):
    """The chat.completion.chunk events of a stream, from app._events' (kind, value) pairs. With tools, text that
    may begin a tool call is held back (runtime/prompt/tool_calls.held_from) and read at the end: each call is a delta with
    its index, id, type and name, then one with its arguments, as OpenAI streams them; finish_reason tool_calls.
    logprobs: each content chunk carries the entries of the tokens received since the chunk before (a token's text
    held back goes with the chunk that sends it; tokens whose text never comes, with the finish chunk): all the
    chunks' entries together are the whole answer's, as the answer that is not streamed has them."""
    extra = {"usage": None} if include_usage else {}
    yield chunk(cid, model, {"role": "assistant", "content": ""}, logprobs=[] if logprobs else None, **extra)
    text, sent = "", 0
    pending: list[dict] | None = [] if logprobs else None

    def taken() -> list[dict] | None:
        nonlocal pending
        out, pending = pending, ([] if logprobs else None)
        return out

    async for kind, value in events:
        if kind == "logprobs":
            pending += value
        elif kind == "piece" and tools is None:
            yield chunk(cid, model, {"content": value}, logprobs=taken(), **extra)
        elif kind == "piece":
            text += value
            upto = held_from(tools.fmt, text)
            if upto > sent:
                yield chunk(cid, model, {"content": text[sent:upto]}, logprobs=taken(), **extra)
                sent = upto
        elif kind == "done":
            finish = FINISH.get(value.stop_reason, "stop")
            if tools is not None:
                content, calls = tools.read(value.text)
                rest = (content[sent:] if calls else value.text[sent:]) if value.text.startswith(text[:sent]) else ""
                if rest and (rest.strip() or not calls):
                    yield chunk(cid, model, {"content": rest}, logprobs=taken(), **extra)
                for i, c in enumerate(calls):
                    named = {"index": i, "id": c["id"], "type": "function",
                             "function": {"name": c["function"]["name"], "arguments": ""}}
                    yield chunk(cid, model, {"tool_calls": [named]}, **extra)
                    yield chunk(cid, model, {"tool_calls": [{"index": i, "function": {
                        "arguments": c["function"]["arguments"]}}]}, **extra)
                finish = "tool_calls" if calls else finish
            yield chunk(cid, model, {}, finish, logprobs=taken() or None, vlmrt=timings(value), **extra)
            if include_usage:
                yield chunk(cid, model, None, usage=usage(value))
            yield DONE
        else:  # an error after the first piece: the stream has begun, so the error is an event
            yield b"data: " + json.dumps(value.body()).encode() + b"\n\n"
