"""POST /v1/responses, the Responses API: a request translated into a chat-completions body (then checked by
request.parse_body like any chat request: the same limits, URL policy and media budgets), and its answer as a
`response` object or as the Responses stream's typed events.

    chat = to_chat(body)                         # 400 naming the field for what this server does not do
    req = parse_body(chat, max_images)           # request.py
    response(rid, mid, model, body, f)           # the answer; stream(events, rid, mid, model, body): its events

Stateless, as this server's chat route: `store: true`, `previous_response_id` and `conversation` are refused (the
client sends the whole conversation in `input`); `text.format` json_schema / json_object holds the answer to the
schema (runtime/decode/grammar.py); `tools` are refused (docs/server.md, "The Responses API").
"""

from __future__ import annotations

import json
import time
import uuid

from ..runtime.decode.grammar import GrammarError, GrammarSpec
from .errors import APIError, bad_request
from .request import number
from .responses import FINISH, timings

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


def new_ids() -> tuple[str, str]:
    """(response id, output message id)."""
    return "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]


def _refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", "invalid_request_error", "unsupported_parameter", param=param)


def _refusals(body: dict) -> None:
    """The fields asking for what this server does not do: one 400 naming the first."""
    stateless = "this server is stateless and keeps no responses; send the whole conversation in input"
    if body.get("previous_response_id") is not None:
        raise _refuse("previous_response_id", stateless)
    if body.get("store") not in (None, False):
        raise _refuse("store", stateless + " (store: false)")
    if body.get("conversation") is not None:
        raise _refuse("conversation", stateless)
    if body.get("background") not in (None, False):
        raise _refuse("background", "background responses need stored responses; this server is stateless")
    if body.get("prompt") is not None:
        raise _refuse("prompt", "stored prompt templates are not supported")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("text must be an object ({\"format\": {\"type\": \"text\"}})", "invalid_parameter")
    if body.get("tools"):
        raise _refuse("tools", "tools in the Responses API are not supported by this server (chat completions takes "
                               "tools)")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _refuse("tool_choice", "tools in the Responses API are not supported by this server")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise bad_request("include must be a list of strings", "invalid_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise _refuse("truncation", "only \"disabled\": a conversation over the context is a 400, never cut")


def _part(p, where: str) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in TEXT_PARTS:
        if not isinstance(p.get("text"), str):
            raise bad_request(f"{where}: {kind} needs a text string", "invalid_content_part")
        return {"type": "text", "text": p["text"]}
    if kind == "refusal" and isinstance(p.get("refusal"), str):  # an earlier answer's refusal, as its text
        return {"type": "text", "text": p["refusal"]}
    if kind == "input_image":
        url = p.get("image_url")
        if p.get("file_id") is not None or not isinstance(url, str) or not url:
            raise bad_request(f"{where}: input_image needs image_url (a data URI, an http(s) URL or a media-folder "
                              "path); file_id is not supported (no file store)", "invalid_content_part")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"{where}: unknown content part type {kind!r} (input_text, input_image, or output_text in an "
                      "assistant message)", "invalid_content_part")


def _messages(raw, instructions) -> list[dict]:
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty list of message items", "invalid_request")
    out = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be a message item ({{\"role\", \"content\"}})", "invalid_request")
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{where}: item type {str(kind)[:40]!r} is not supported (message items only: function "
                              "calls and their outputs need tools, which the Responses API here does not take)",
                              "invalid_request")
        if item.get("role") not in ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(ROLES)}", "invalid_request")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        elif not isinstance(content, str):
            raise bad_request(f"{where}: content must be a string or a list of parts", "invalid_request")
        out.append({"role": item["role"], "content": content})
    return out


LOGPROBS = "message.output_text.logprobs"  # the include entry that asks for the output text's logprobs


def _logprobs(body: dict) -> dict:
    """include LOGPROBS and top_logprobs as chat's logprobs and top_logprobs (checked by parse_body as chat's are,
    named as here: top_logprobs over 0 without the include entry is a 400)."""
    if LOGPROBS in (body.get("include") or ()):
        return {"logprobs": True, "top_logprobs": body.get("top_logprobs")}
    top = body.get("top_logprobs")
    if top not in (None, 0):
        if isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20:
            raise APIError(400, f"top_logprobs: needs include [\"{LOGPROBS}\"]", "invalid_request_error",
                           "invalid_parameter", param="top_logprobs")
        return {"logprobs": False, "top_logprobs": top}  # (parse_body names what is wrong with it)
    return {}


def to_chat(body: dict) -> dict:
    """A Responses request -> the chat-completions body that asks for the same answer."""
    _refusals(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "invalid_parameter")
    chat = {"messages": _messages(body.get("input"), instructions), "stream": body.get("stream", False)}
    try:  # the Responses API's format is flat: {"type": "json_schema", "name", "schema", "strict"}
        chat["response_format"] = GrammarSpec.from_response_format((body.get("text") or {}).get("format"),
                                                                   "text.format", flat=True)
    except GrammarError as e:
        raise APIError(400, str(e), "invalid_request_error", "invalid_parameter", param=e.param) from None
    tokens = number(body, "max_output_tokens", int, 1)
    if tokens is not None:
        chat["max_completion_tokens"] = tokens
    for name in ("temperature", "top_p", "seed", "top_k", "ignore_eos"):  # checked by parse_body as chat's are
        if body.get(name) is not None:
            chat[name] = body[name]
    return {**chat, **_logprobs(body)}


def _usage(f) -> dict:
    return {"input_tokens": f.prompt_tokens, "input_tokens_details": {"cached_tokens": f.stats["reused_prompt_tokens"]},
            "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def _message(mid: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _response(rid: str, model: str, body: dict, status: str, output: list, created: int, **extra) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "top_logprobs": body.get("top_logprobs"), "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}}, "truncation": "disabled",
            "store": False,
            "previous_response_id": None, "metadata": body.get("metadata") or {}, "usage": None, **extra}


def _finished(rid: str, mid: str, model: str, body: dict, f, created: int) -> dict:
    """The finished response: completed, or incomplete (max_output_tokens) where the answer ran out of tokens."""
    cut = FINISH.get(f.stop_reason, "stop") == "length"
    return _response(rid, model, body, "incomplete" if cut else "completed",
                     [_message(mid, f.text, "incomplete" if cut else "completed", f.logprobs)], created,
                     incomplete_details={"reason": "max_output_tokens"} if cut else None, usage=_usage(f),
                     vlmrt=timings(f))


def response(rid: str, mid: str, model: str, body: dict, f) -> dict:
    return _finished(rid, mid, model, body, f, int(time.time()))


def _event(kind: str, seq: int, **fields) -> bytes:
    return (f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, "sequence_number": seq, **fields}).encode()
            + b"\n\n")


async def stream(events, rid: str, mid: str, model: str, body: dict):
    """The Responses stream: response.created, response.in_progress, the message item and its output_text part
    added, response.output_text.delta per piece (with include LOGPROBS: the logprobs of the tokens since the delta
    before), then the text (all the logprobs), part and item done and response.completed (or response.incomplete);
    an error after the first piece is an `error` event, then response.failed."""
    created, seq = int(time.time()), 0
    at = {"item_id": mid, "output_index": 0, "content_index": 0}

    def ev(kind, **fields):
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    started = _response(rid, model, body, "in_progress", [], created)
    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    item = {**_message(mid, "", "in_progress"), "content": []}
    yield ev("response.output_item.added", output_index=0, item=item)
    yield ev("response.content_part.added", **at, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})
    pending: list[dict] = []
    async for kind, value in events:
        if kind == "logprobs":
            pending += value
        elif kind == "piece":
            yield ev("response.output_text.delta", **at, delta=value, logprobs=pending)
            pending = []
        elif kind == "done":
            done = _finished(rid, mid, model, body, value, created)
            msg = done["output"][0]
            yield ev("response.output_text.done", **at, text=value.text, logprobs=msg["content"][0]["logprobs"])
            yield ev("response.content_part.done", **at, part=msg["content"][0])
            yield ev("response.output_item.done", output_index=0, item=msg)
            yield ev("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
        else:  # an error after the first piece: the stream has begun
            err = value.body()["error"]
            yield ev("error", code=err["code"], message=err["message"], param=None)
            yield ev("response.failed", response=_response(rid, model, body, "failed", [], created,
                                                           error={"code": err["code"], "message": err["message"]}))
