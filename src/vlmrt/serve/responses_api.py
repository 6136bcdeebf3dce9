"""POST /v1/responses, the Responses API: a request translated into a chat-completions body (then checked by
request.parse_body like any chat request: the same limits, URL policy and media budgets), and its answer as a
`response` object or as the Responses stream's typed events.

    chat = to_chat(body)                         # 400 naming the field for what this server does not do
    req = parse_body(chat, max_images)           # request.py
    response(rid, mid, model, body, f)           # the answer; stream(events, rid, mid, model, body): its events

Stateless, as this server's chat route: `store: true`, `previous_response_id` and `conversation` are refused (the
client sends the whole conversation in `input`); `text.format` json_schema / json_object holds the answer to the
schema (runtime/decode/grammar.py). Function tools (the Responses shape: flat {"type": "function", "name",
"parameters", "strict"}) and tool_choice become chat's; `function_call` / `function_call_output` input items an
assistant's tool_calls and tool messages; an answer's calls `function_call` output items, streamed as OpenAI streams
them (docs/server.md, "The Responses API"). A 400 from the chat checks names the Responses field (renamed).
"""

from __future__ import annotations

import json
import re
import time
import uuid

from ..runtime.decode.grammar import GrammarError, GrammarSpec
from ..runtime.prompt.tool_calls import held_from
from .errors import APIError, bad_request
from .request import number
from .responses import FINISH, ToolReader, timings

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
        if kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": out[-1].get("tool_calls", []) + [call]}  # (the same turn)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            out.append(_function_output(item, where))
            continue
        if kind != "message":
            raise bad_request(f"{where}: item type {str(kind)[:40]!r} is not supported (message, function_call and "
                              "function_call_output items)", "invalid_request")
        if item.get("role") not in ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(ROLES)}", "invalid_request")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        elif not isinstance(content, str):
            raise bad_request(f"{where}: content must be a string or a list of parts", "invalid_request")
        out.append({"role": item["role"], "content": content})
    return out


def _invalid(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", "invalid_request_error", "invalid_parameter", param=param)


def _function_call(item: dict, where: str) -> dict:
    """A function_call input item (an earlier answer's call) as a chat tool_calls entry."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise _invalid(f"{where}.{key}", "a function_call item needs call_id, name and arguments (strings)")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _function_output(item: dict, where: str) -> dict:
    """A function_call_output input item as a chat tool message (its output a string or input_text parts)."""
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise _invalid(f"{where}.call_id", "a function_call_output item needs the call_id of a function_call")
    output = item.get("output")
    if isinstance(output, list):
        for j, p in enumerate(output):
            if not isinstance(p, dict) or p.get("type") != "input_text" or not isinstance(p.get("text"), str):
                raise _invalid(f"{where}.output[{j}]", "a function's output is text: a string or input_text parts")
        output = "".join(p["text"] for p in output)
    if not isinstance(output, str):
        raise _invalid(f"{where}.output", "must be a string or a list of input_text parts")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


TOOL_FIELDS = ("name", "description", "parameters", "strict")


def _tools(body: dict) -> dict:
    """tools (function tools, flat) and tool_choice as chat's fields (checked there, named back by renamed)."""
    out: dict = {}
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise _invalid("tools", "must be a list of function tools ({\"type\": \"function\", \"name\", "
                                    "\"parameters\", \"strict\"})")
        tools = []
        for i, t in enumerate(raw):
            if isinstance(t, dict) and t.get("type") not in ("function", None):
                raise _refuse(f"tools[{i}].type", f"{str(t['type'])[:40]!r} tools are not supported by this server "
                                                  "(function tools only: it runs no hosted tools)")
            if not isinstance(t, dict) or t.get("type") is None:
                raise _invalid(f"tools[{i}]", "must be {\"type\": \"function\", \"name\", \"parameters\"}")
            extra = sorted(set(map(str, t)) - {"type", *TOOL_FIELDS})
            if extra:
                raise _invalid(f"tools[{i}].{extra[0][:40]}", "unknown field")
            tools.append({"type": "function", "function": {k: t[k] for k in TOOL_FIELDS if k in t}})
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _refuse("tool_choice", "only \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                         "\"name\"} (no hosted tools, no allowed_tools)")
        if not isinstance(choice.get("name"), str):
            raise _invalid("tool_choice.name", "must be a function's name")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def renamed(e: APIError) -> APIError:
    """A 400 of the chat checks with the field named as the Responses API names it (tools[0].function.name ->
    tools[0].name, tool_choice.function.name -> tool_choice.name)."""
    param = e.extra.get("param")
    if not isinstance(param, str):
        return e
    new = re.sub(r"^(tools\[\d+\]|tool_choice)\.function(?=\.|$)", r"\1", param)
    if new == param:
        return e
    message = new + e.message[len(param):] if e.message.startswith(param) else e.message
    return APIError(e.status, message, e.type, e.code, **{**e.extra, "param": new})


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
    return {**chat, **_tools(body), **_logprobs(body)}


def _usage(f) -> dict:
    return {"input_tokens": f.prompt_tokens, "input_tokens_details": {"cached_tokens": f.stats["reused_prompt_tokens"]},
            "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def _message(mid: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _function_call_item(call: dict, status: str = "completed") -> dict:
    """One of the answer's calls (ToolReader's, chat's shape) as a function_call output item (its id fc_ + the
    call's own hex, so that a stream's events and its final response name it alike)."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if status == "completed"
            else "", "status": status}


def _response(rid: str, model: str, body: dict, status: str, output: list, created: int, **extra) -> dict:
    tools = [{"type": "function", **{k: t.get(k) for k in TOOL_FIELDS}} for t in body.get("tools") or ()
             if isinstance(t, dict)]
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "top_logprobs": body.get("top_logprobs"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}}, "truncation": "disabled",
            "store": False,
            "previous_response_id": None, "metadata": body.get("metadata") or {}, "usage": None, **extra}


def _finished(rid: str, model: str, body: dict, f, created: int, output: list) -> dict:
    """The finished response: completed, or incomplete (max_output_tokens) where the answer ran out of tokens (not
    where its calls were read: they are whole)."""
    cut = _status(f, [i for i in output if i["type"] == "function_call"]) == "incomplete"
    return _response(rid, model, body, "incomplete" if cut else "completed", output, created,
                     incomplete_details={"reason": "max_output_tokens"} if cut else None, usage=_usage(f),
                     vlmrt=timings(f))


def _status(f, calls=()) -> str:
    """An answer's status: incomplete where it ran out of tokens, unless its calls were read (they are whole)."""
    return "incomplete" if FINISH.get(f.stop_reason, "stop") == "length" and not calls else "completed"


def response(rid: str, mid: str, model: str, body: dict, f, tools: ToolReader | None = None) -> dict:
    """The answer as a response object: one message item, or with tools the text around the answer's calls (where
    there is any) and a function_call item per call."""
    content, calls = tools.read(f.text) if tools is not None else (f.text, [])
    output = [_message(mid, f.text if not calls else content.strip(), _status(f, calls), f.logprobs)] \
        if not calls or content.strip() else []
    output += [_function_call_item(c) for c in calls]
    return _finished(rid, model, body, f, int(time.time()), output)


def _event(kind: str, seq: int, **fields) -> bytes:
    return (f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, "sequence_number": seq, **fields}).encode()
            + b"\n\n")


async def stream(events, rid: str, mid: str, model: str, body: dict, tools: ToolReader | None = None):
    """The Responses stream: response.created, response.in_progress, the message item and its output_text part
    added, response.output_text.delta per piece (with include LOGPROBS: the logprobs of the tokens since the delta
    before), then the text (all the logprobs), part and item done and response.completed (or response.incomplete);
    an error after the first piece is an `error` event, then response.failed. With tools, text that may begin a call
    is held back (tool_calls.held_from; the message item is opened with the first text sent) and the calls are read
    at the end: per call response.output_item.added (a function_call item, in_progress), one
    response.function_call_arguments.delta with the arguments, response.function_call_arguments.done and
    response.output_item.done, as OpenAI streams them."""
    created, seq = int(time.time()), 0
    at = {"item_id": mid, "output_index": 0, "content_index": 0}
    text, said, opened = "", "", False  # (said: the text the deltas sent)
    pending: list[dict] = []

    def ev(kind, **fields):
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    def open_message():
        nonlocal opened
        opened = True
        item = {**_message(mid, "", "in_progress"), "content": []}
        yield ev("response.output_item.added", output_index=0, item=item)
        yield ev("response.content_part.added", **at, part={"type": "output_text", "text": "", "annotations": [],
                                                            "logprobs": []})

    def delta(piece):
        nonlocal pending, said
        if not opened:
            yield from open_message()
        yield ev("response.output_text.delta", **at, delta=piece, logprobs=pending)
        pending, said = [], said + piece

    started = _response(rid, model, body, "in_progress", [], created)
    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    if tools is None:
        for e in open_message():
            yield e
    async for kind, value in events:
        if kind == "logprobs":
            pending += value
        elif kind == "piece":
            text += value
            upto, sent = len(text) if tools is None else held_from(tools.fmt, text), len(said)
            if upto > sent:
                for e in delta(text[sent:upto]):
                    yield e
        elif kind == "done":
            content, calls = tools.read(value.text) if tools is not None else (value.text, [])
            if tools is not None and value.text.startswith(said):
                rest = content[len(said):] if calls else value.text[len(said):]
                if rest and (rest.strip() or not calls):
                    for e in delta(rest):
                        yield e
            output = []
            if opened or not calls:
                if not opened:
                    for e in open_message():
                        yield e
                msg = _message(mid, said if tools is not None else value.text, _status(value, calls),
                               value.logprobs)
                yield ev("response.output_text.done", **at, text=msg["content"][0]["text"],
                         logprobs=msg["content"][0]["logprobs"])
                yield ev("response.content_part.done", **at, part=msg["content"][0])
                yield ev("response.output_item.done", output_index=0, item=msg)
                output.append(msg)
            for c in calls:
                item, n = _function_call_item(c), len(output)
                yield ev("response.output_item.added", output_index=n, item=_function_call_item(c, "in_progress"))
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=n,
                         delta=item["arguments"])
                yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                         name=item["name"], arguments=item["arguments"])
                yield ev("response.output_item.done", output_index=n, item=item)
                output.append(item)
            done = _finished(rid, model, body, value, created, output)
            yield ev("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
        else:  # an error after the first piece: the stream has begun
            err = value.body()["error"]
            yield ev("error", code=err["code"], message=err["message"], param=None)
            yield ev("response.failed", response=_response(rid, model, body, "failed", [], created,
                                                           error={"code": err["code"], "message": err["message"]}))
