"""An OpenAI chat-completions request body -> a checked ChatRequest (every problem one 400 APIError).

Fields read: messages (system / developer / user / assistant / tool; content a string or text / image_url / video_url
parts (video_url as vLLM takes it: {"type": "video_url", "video_url": {"url": ...}}); an assistant's tool_calls, a
tool message's tool_call_id), tools and tool_choice (none / auto / required / a named function: the last two held to
the calls' grammar by the app), response_format (text / json_object / json_schema: a GrammarSpec,
runtime/decode/grammar.py), stream, stream_options.include_usage, max_completion_tokens / max_tokens, temperature,
top_p, seed, stop, n (1 only), logprobs and top_logprobs (0..20), and the extensions llama.cpp and vLLM also take:
top_k, ignore_eos. Fields asking for what vlmrt does not do (penalties, logit_bias, audio) are refused (400
unsupported_parameter) unless they ask for the default, which is what ignoring them gives; the others (model, user,
metadata, store, ...) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field

from ..runtime.decode.grammar import GrammarError, GrammarSpec
from ..runtime.decode.logprobs import MAX_TOP
from ..runtime.prompt.conversation import ConversationError, parse_messages
from .errors import APIError, bad_request

MAX_STOP = 16
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
MAX_VIDEOS = 1  # a video is up to the bundle's max frames (64 for SmolVLM2) of images already


@dataclass
class ChatRequest:
    messages: list[dict]  # roles mapped, content as parts; image_url parts still hold their url
    urls: list[str]  # the image_url urls, in order
    key: list  # per message (role, parts) with images as the sha256 of their url: the slot affinity key
    video_urls: list[str] = field(default_factory=list)  # the video_url urls, in order
    stream: bool = False
    include_usage: bool = False
    options: dict = field(default_factory=dict)  # VLM.chat keyword arguments (tools, unless tool_choice none;
    # response_format: a GrammarSpec)
    tools: list[dict] | None = None  # the functions the answer may call (tool_choice auto); None: a text answer


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad_request("the body is not valid JSON: nested too deeply", "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise bad_request(f"the body is not valid JSON: {e}", "invalid_json") from None


def number(body: dict, name: str, kind, lo=None, hi=None, lo_open=False):
    v = body.get(name)
    if v is None:
        return None
    # JSON may also carry NaN, Infinity and integers too large for a float
    ok = isinstance(v, int) and not isinstance(v, bool) or (
        isinstance(v, float) and math.isfinite(v) and (kind is float or v.is_integer()))
    if not ok:
        raise bad_request(f"{name} must be {'a finite number' if kind is float else 'an integer'}", "invalid_parameter")
    try:
        v = kind(v)
    except OverflowError:
        raise bad_request(f"{name} is out of range", "invalid_parameter") from None
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        span = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise bad_request(f"{name} must be in {span}, not {str(v)[:40]}", "invalid_parameter")
    return v


def _text_only(v) -> bool:
    return v is None or v == ["text"]


# field -> (is the value what vlmrt does anyway?, what vlmrt does not do); "auto" tool_choice without tools is harmless
UNSUPPORTED = {
    "functions": (lambda v, b: not v, "functions (function calling) are not supported"),
    "function_call": (lambda v, b: v in (None, "none", "auto"), "functions (function calling) are not supported"),
    "frequency_penalty": (lambda v, b: v in (None, 0), "repetition penalties are not supported (only 0)"),
    "presence_penalty": (lambda v, b: v in (None, 0), "repetition penalties are not supported (only 0)"),
    "logit_bias": (lambda v, b: not v, "logit_bias is not supported"),
    "modalities": (lambda v, b: _text_only(v), "only text output"),
    "audio": (lambda v, b: v is None, "only text output"),
}


def _unsupported(body: dict) -> None:
    for name, (default, why) in UNSUPPORTED.items():
        v = body.get(name)
        if not default(v, body):
            shown = f" {json.dumps(v)[:40]}" if isinstance(v, (bool, int, float, str)) else ""
            raise APIError(400, f"{name}{shown}: {why} by this server", "invalid_request_error",
                           "unsupported_parameter", param=name)


def _stop(v) -> list[str] | None:
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_request(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "invalid_parameter")
    return stops


MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # content part type -> its kind in the cache key


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_request_error", "invalid_parameter", param=param)


def _tool_choice(choice, names: list[str]) -> str | None:
    """tool_choice checked: none, auto, required, or {"type": "function", "function": {"name"}} (-> the name)."""
    if choice in (None, "none", "auto", "required"):
        if choice == "required" and not names:
            raise _invalid("tool_choice", "\"required\" needs tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _invalid("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}")
    if name not in names:
        raise _invalid("tool_choice.function.name", f"{name[:64]!r} is not one of the tools")
    return name


def _tools(body: dict) -> tuple[list[dict] | None, str | None]:
    """tools ([{"type": "function", "function": {"name", "description", "parameters", "strict"}}], checked: a
    malformed one or an unknown field is a 400 naming it) and tool_choice: (the tools the answer may call, None when
    it is text (no tools, or tool_choice none); "required" or the function's name when the answer must call (VLM.chat's
    tool_choice: held to the calls' grammar), None when it may answer in text)."""
    raw = body.get("tools")
    if raw is None or raw == []:
        _tool_choice(body.get("tool_choice"), [])
        return None, None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _invalid("tools", f"must be a list of at most {MAX_TOOLS} functions")
    out, names = [], set()
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _invalid(at, "must be {\"type\": \"function\", \"function\": {\"name\", \"description\", "
                               "\"parameters\"}}")
        f = t["function"]
        for extra, where in ((set(t) - {"type", "function"}, at), (set(f) - {"name", "description", "parameters",
                                                                             "strict"}, at + ".function")):
            if extra:
                name = sorted(map(str, extra))[0]
                raise _invalid(f"{where}.{name[:40]}", "unknown field")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _invalid(at + ".function.name", "must be 1 to 64 letters, digits, _ or -")
        if name in names:
            raise _invalid(at + ".function.name", f"{name!r} is given twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise _invalid(at + ".function.description", "must be a string")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise _invalid(at + ".function.parameters", "must be a JSON Schema object")
        if f.get("strict") not in (None, False, True):
            raise _invalid(at + ".function.strict", "must be a boolean")
        # (strict: true kept for VLM.chat, which holds those calls to their schemas and renders them without it)
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters", "strict")
                                                      if f.get(k) not in (None, False)}})
    choice = _tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in out])
    if choice not in (None, "none", "auto"):  # required, or a named function
        return out, choice
    return (None if choice == "none" else out), None


def logprobs(body: dict, top_name: str = "top_logprobs") -> int | None:
    """The top tokens to list beside each answer token's log probability (0..20), None where logprobs is not asked
    for: logprobs a boolean, top_logprobs (top_name) an integer in [0, 20] that needs logprobs true when over 0."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise _invalid("logprobs", "must be a boolean")
    top = body.get(top_name)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP):
        raise _invalid(top_name, f"must be an integer in [0, {MAX_TOP}], not {json.dumps(top)[:40]}")
    if top and not asked:
        raise _invalid(top_name, "needs logprobs: true")
    return (top or 0) if asked else None


def _messages(raw) -> tuple[list[dict], list[str], list, list[str]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list of {role, content} objects")
    out, urls, key, video_urls = [], [], [], []
    for i, m in enumerate(raw):
        where = f"message {i + 1}"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: must be an object with role and content")
        role = "system" if m.get("role") == "developer" else m.get("role")
        content = m.get("content")
        parts, kparts = content, []
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text":
                    kparts.append(("text", p.get("text")))
                elif kind in MEDIA_PARTS:
                    u = p.get(kind)
                    url = u.get("url") if isinstance(u, dict) else None
                    if not isinstance(url, str) or not url:
                        raise bad_request(f"{where}, part {j + 1}: {kind} needs {{\"url\": ...}}", "invalid_content_part")
                    (urls if kind == "image_url" else video_urls).append(url)
                    kparts.append((MEDIA_PARTS[kind], hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()))
                else:
                    raise bad_request(f"{where}, part {j + 1}: unknown content part type {kind!r} (text, image_url or "
                                      "video_url)", "invalid_content_part")
                parts.append(p)
        else:
            kparts.append(("text", content))
        extra = {k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k) is not None}
        kparts += [(k, json.dumps(v, sort_keys=True)) for k, v in extra.items()]  # (checked by parse_messages below)
        out.append({"role": role, "content": parts, **extra})
        key.append((role, tuple(kparts)))
    try:
        parse_messages(out)  # roles, text types, images only in user turns, the last turn the user's
    except ConversationError as e:
        raise bad_request(str(e)) from None
    return out, urls, key, video_urls


def parse_request(raw: bytes, max_images: int) -> ChatRequest:
    return parse_body(parse_json(raw), max_images)


def parse_json(raw: bytes) -> dict:
    """A request body: a JSON object."""
    body = _json(raw)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def parse_body(body: dict, max_images: int) -> ChatRequest:
    """A chat-completions request (parsed JSON; the Responses API's translated into one: responses_api.py)."""
    messages, urls, key, video_urls = _messages(body.get("messages"))
    if len(urls) > max_images:
        raise bad_request(f"{len(urls)} images; this server takes at most {max_images} per request", "too_many_images")
    if len(video_urls) > MAX_VIDEOS:
        raise bad_request(f"{len(video_urls)} videos; this server takes at most {MAX_VIDEOS} per request", "too_many_images")
    n = number(body, "n", int)
    if n not in (None, 1):
        raise bad_request("only n = 1 is supported", "invalid_parameter")
    _unsupported(body)
    tools, forced = _tools(body)
    fmt = body.get("response_format")
    try:  # (a GrammarSpec already: the Responses API's text.format, responses_api.to_chat)
        fmt = fmt if isinstance(fmt, GrammarSpec) else GrammarSpec.from_response_format(fmt)
    except GrammarError as e:
        raise APIError(400, str(e), "invalid_request_error", "invalid_parameter", param=e.param) from None
    if fmt is not None and forced:
        raise _invalid("response_format", "a response format and a required or named tool_choice ask for two answers")
    stream = body.get("stream", False)
    so = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise bad_request("stream must be a boolean and stream_options an object ({\"include_usage\": a boolean})",
                          "invalid_parameter")
    tokens = number(body, "max_completion_tokens", int, 1)
    tokens = tokens if tokens is not None else number(body, "max_tokens", int, 1)
    opts = {
        "max_new_tokens": tokens,
        "temperature": number(body, "temperature", float, 0, 2),
        "top_p": number(body, "top_p", float, 0, 1, lo_open=True),
        "top_k": number(body, "top_k", int, 0),
        "seed": number(body, "seed", int, 0, 2**64 - 1),
        "stop": _stop(body.get("stop")),
        "ignore_eos": body.get("ignore_eos"),
        "tools": tools,
        "tool_choice": forced,
        "parallel_tool_calls": None if not forced or body.get("parallel_tool_calls") is not False else False,
        "response_format": fmt,
        "logprobs": logprobs(body),
    }
    if opts["ignore_eos"] is not None and not isinstance(opts["ignore_eos"], bool):
        raise bad_request("ignore_eos must be a boolean", "invalid_parameter")
    return ChatRequest(messages, urls, key, video_urls, stream, bool(so.get("include_usage")),
                       {k: v for k, v in opts.items() if v is not None}, tools)
