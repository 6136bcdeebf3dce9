"""Conversations: OpenAI-style chat messages -> the prompt text, rendered by the checkpoint's own chat template.

    conv = parse_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://.../cat.jpg"}},
        {"type": "text", "text": "What is this?"}]}])
    pieces = ChatTemplate(manifest.prompt).render(conv)   # text, with None where each image goes, in order

The manifest carries the template (PromptSpec.chat_template) and how it takes content; it is rendered with jinja2
the way transformers' apply_chat_template does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols), so that
position-dependent template logic (a default system turn, "User:" vs "User: " before an image) comes out as the
reference's. runtime/prompt/build.py then puts each image's expansion (its host op) where the rendered placeholder was,
as the processors do, and tokenizes the whole: the one way every caller builds a prompt.

Message text is the client's: a control token's string in it (`<|im_start|>`, `<end_of_utterance>`, `<row_1_col_1>`:
the tokenizer's special added tokens, ChatTemplate(literal=...)) comes out of render() as a Literal piece, which
runtime/prompt/build.py tokenizes as plain text, so that relayed text cannot forge a turn boundary or an image marker; the
template's own markers stay tokens (docs/conversations.md#control-tokens-in-message-text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ...format.manifest import PromptSpec
from .tool_calls import generic_result_text, generic_system_text, tool_format

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    pass


class Literal(str):
    """A piece of the rendered prompt that message text supplied and that is a control token's string: tokenized as
    plain text (special tokens off), not as that token."""


def control_strings(tokenizer) -> list[str]:
    """The strings a tokenizer turns into its special added tokens (what transformers' split_special_tokens=True
    and tokenizers' encode_special_tokens tokenize as text instead): the control tokens message text may not forge."""
    return sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content})


def template_env():
    """A Jinja environment set up like transformers' chat-template rendering."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter (jinja2's would escape <, >, & and ' and sort the keys): tool definitions and
        # tool-call arguments come out as the checkpoint's template renders them there
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env


def video_refusal(p: PromptSpec) -> str | None:
    """Why a bundle of this prompt spec takes no videos (None: it takes them), said before a video is read."""
    if p.video is None:
        return ("this bundle takes no videos: its checkpoint's processor reads none, or it was exported by an older "
                "vlmrt (re-export a SmolVLM2 or Gemma 4 checkpoint)")
    if p.content_format != "parts":
        return "this bundle's chat template takes no videos"
    return None


@dataclass
class VideoSource:
    source: Any  # a path (file or folder of frames), URL, data URI, or a list of PIL images
    fps: float | None = None  # the frame rate of a folder's (or a list's) frames


@dataclass
class Conversation:
    """Messages with content as parts: {"type": "text", "text": ...}, {"type": "image", "index": i}, images[i]
    being the image's source (a path, URL, data URI or PIL image), or {"type": "video", "index": j}, videos[j] a
    VideoSource. An assistant message may also hold "tool_calls" ([{"id", "name", "arguments": dict}]), a tool
    message its "tool_call_id" and "name" (the call's function). tools: the functions the answer may call (OpenAI's
    [{"type": "function", "function": {"name", "description", "parameters"}}]), rendered by the template."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    videos: list[VideoSource] = field(default_factory=list)
    tools: list[dict] | None = None


def user_turn(prompt: str, images: list, videos: list = ()) -> list[dict]:
    """One user message: the videos, the images in order, then the text (what `vlmrt run --image / --video ...
    --prompt` asks); videos: sources or VideoSource."""
    vids = [{"type": "video", "video": v.source, "fps": v.fps} if isinstance(v, VideoSource) else
            {"type": "video", "video": v} for v in videos]
    return [{"role": "user", "content": vids + [{"type": "image", "image": im} for im in images]
             + [{"type": "text", "text": prompt}]}]


def _video_source(part: dict, where: str) -> VideoSource:
    """{"type": "video_url", "video_url": {"url"}} (OpenAI-style, as vLLM takes it) or {"type": "video", "video" |
    "url" | "path": ...}; an optional "fps" for a folder of frames."""
    if part["type"] == "video_url":
        u = part.get("video_url")
        src = u.get("url") if isinstance(u, dict) else u
        if not isinstance(src, str) or not src:
            raise ConversationError(f"{where}: video_url needs a url (a path, an http(s) URL or a data URI)")
    else:
        src = next((part[k] for k in ("video", "url", "path") if part.get(k) is not None), None)
        if src is None:
            raise ConversationError(f"{where}: a video part needs video_url.url (or video / url / path)")
    fps = part.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000):
        raise ConversationError(f"{where}: fps must be a number in (0, 1000]")
    if isinstance(src, str) and not is_unicode(src):
        raise ConversationError(f"{where}: the video's url is not valid Unicode")
    return VideoSource(src, fps)


def _image_source(part: dict, where: str):
    kind = part["type"]
    if kind == "image_url":
        u = part.get("image_url")
        url = u.get("url") if isinstance(u, dict) else u
        if not isinstance(url, str) or not url:
            raise ConversationError(f"{where}: image_url needs a url (a path, an http(s) URL or a data URI)")
        return url
    for k in ("image", "url", "path"):  # transformers-style {"type": "image", "image" | "url" | "path": ...}
        if part.get(k) is not None:
            return part[k]
    raise ConversationError(f"{where}: an image part needs image_url.url (or image / url / path)")


def is_unicode(s: str) -> bool:
    """Whether s can be encoded (tokenized, written, used as a path): JSON's \\ud800 escapes (and Python strings) may
    hold lone surrogates."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(text: str, where: str) -> str:
    """text, if it can be tokenized."""
    if not is_unicode(text):
        raise ConversationError(f"{where}: the text is not valid Unicode (it holds a lone surrogate)")
    return text


def _tool_calls(raw, where: str) -> list[dict]:
    """An assistant message's tool_calls (OpenAI's [{"id", "type": "function", "function": {"name", "arguments":
    a JSON object as a string (or the object)}}]) -> [{"id", "name", "arguments": dict}]."""
    if not isinstance(raw, list) or not raw:
        raise ConversationError(f"{where}: tool_calls must be a non-empty list of calls")
    out = []
    for k, c in enumerate(raw):
        at = f"{where}: tool_calls[{k}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(f, dict):
            raise ConversationError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                    "\"arguments\"}}}}")
        extra = sorted(set(c) - {"id", "type", "function", "index"}) or sorted(set(f) - {"name", "arguments"})
        if extra:
            raise ConversationError(f"{at}: unknown field {extra[0]!r}")
        if not isinstance(c.get("id"), str) or not c["id"] or not isinstance(f.get("name"), str) or not f["name"]:
            raise ConversationError(f"{at} needs an id and function.name (non-empty strings)")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise ConversationError(f"{at}: function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise ConversationError(f"{at}: function.arguments must be a JSON object")
        out.append({"id": _text(c["id"], at), "name": _text(f["name"], at), "arguments": args})
    return out


def parse_messages(messages, tools: list[dict] | None = None) -> Conversation:
    """Check and normalize chat messages (OpenAI style); the last one is the user's turn to answer (or a tool
    message's result, to answer after). tools: as Conversation.tools (checked by the caller: serve/request.py)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("messages must be a non-empty list of {role, content} objects")
    out, images, videos = [], [], []
    calls: dict[str, str] = {}  # the earlier assistant messages' tool call ids -> their function's name
    for i, m in enumerate(messages):
        where = f"message {i + 1}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConversationError(f"{where}: needs a role of {', '.join(ROLES)}")
        content = m.get("content")
        extra = {}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            extra["tool_calls"] = _tool_calls(m["tool_calls"], where)
            calls.update((c["id"], c["name"]) for c in extra["tool_calls"])
            content = "" if content is None else content
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ConversationError(f"{where}: a tool message needs tool_call_id (the id of the call it answers)")
            if cid not in calls:
                raise ConversationError(f"{where}: tool_call_id {cid[:40]!r} is not the id of a tool call of an "
                                        "earlier assistant message")
            extra = {"tool_call_id": cid, "name": calls[cid]}
        if isinstance(content, str):
            parts = [{"type": "text", "text": _text(content, where)}]
        elif isinstance(content, list):
            if not content:  # a template indexing content[0] failed with jinja2's "list object has no element 0"
                raise ConversationError(f"{where}: content is an empty list of parts (give a string or at least one part)")
            parts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text":
                    if not isinstance(p.get("text"), str):
                        raise ConversationError(f"{where}, part {j + 1}: text must be a string")
                    parts.append({"type": "text", "text": _text(p["text"], f"{where}, part {j + 1}")})
                elif kind in ("image_url", "image"):
                    if m["role"] != "user":
                        raise ConversationError(f"{where}: images can only be in user messages")
                    images.append(_image_source(p, f"{where}, part {j + 1}"))
                    parts.append({"type": "image", "index": len(images) - 1})
                elif kind in ("video_url", "video"):
                    if m["role"] != "user":
                        raise ConversationError(f"{where}: videos can only be in user messages")
                    videos.append(_video_source(p, f"{where}, part {j + 1}"))
                    parts.append({"type": "video", "index": len(videos) - 1})
                else:
                    raise ConversationError(f"{where}, part {j + 1}: type must be text, image_url, image, video_url or "
                                            "video")
        else:
            raise ConversationError(f"{where}: content must be a string or a list of parts")
        out.append({"role": m["role"], "content": parts, **extra})
    if out[-1]["role"] not in ("user", "tool"):
        raise ConversationError("the last message must be the user's or a tool result (the answer is the next "
                                "assistant turn)")
    return Conversation(out, images, videos, tools or None)


class ChatTemplate:
    """A bundle's chat template, compiled once. literal: control-token strings (control_strings) that message text
    may hold only as text: render() returns each place message text wrote one as a Literal piece; () renders message
    text as the template has it (its control-token strings become those tokens: the allow_special_tokens option)."""

    def __init__(self, p: PromptSpec, literal=()):
        self.p = p
        self._template = self._compile(p.chat_template)
        self.tool_format = tool_format(p.chat_template)  # runtime/prompt/tool_calls.py; None: tools it cannot take
        self._renders_calls = "tool_calls" in p.chat_template  # else an assistant's calls are written as its text
        self._video_template = self._compile(p.video.chat_template) if p.video and p.video.chat_template else \
            self._template
        # longest first: the alternation then matches as the tokenizer's added vocabulary does (leftmost-longest)
        lit = sorted(set(literal), key=lambda t: (-len(t), t))
        self._literal = re.compile("|".join(re.escape(t) for t in lit)) if lit else None

    @staticmethod
    def _compile(source: str):
        try:
            return template_env().from_string(source)
        except Exception as e:  # jinja2 syntax errors
            raise ConversationError(f"cannot compile the bundle's chat template: {e}") from None

    def tools_refusal(self) -> str | None:
        """Why this template takes no tools (None: it does)."""
        if self.tool_format is None:
            return ("this bundle's chat template renders tools in a tool-call format vlmrt does not know "
                    "(runtime/prompt/tool_calls.py lists those it reads)")
        return None

    def _generic(self, conv: Conversation) -> list[dict]:
        """conv's messages with the generic tool format's turns (a template with no tool format of its own): the
        tools described in the system turn, an assistant's calls written as its JSON answer, a tool result a user
        turn."""
        fmt, msgs = self.tool_format, []
        for m in conv.messages:
            if m["role"] == "tool":
                result = "\n".join(part["text"] for part in m["content"] if part["type"] == "text")
                msgs.append({"role": "user", "content": [{"type": "text", "text": generic_result_text(
                    m["name"], m["tool_call_id"], result)}]})
            elif m.get("tool_calls"):
                msgs.append({"role": "assistant", "content": m["content"] + [
                    {"type": "text", "text": fmt.write(m["tool_calls"])}]})
            else:
                msgs.append(m)
        if conv.tools:
            described = {"type": "text", "text": generic_system_text(conv.tools)}
            if msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + [{"type": "text", "text": "\n\n"},
                                                                               described]}
            else:
                msgs.insert(0, {"role": "system", "content": [described]})
        return msgs

    def _template_messages(self, conv: Conversation, text=lambda t: t) -> list[dict]:
        """The messages as the template takes them; text(t): each string of the client's (message text, tool
        definitions, calls and results) as written into them."""
        p, msgs = self.p, []
        own = self.tool_format is None or self.tool_format.renders_tools  # (None: the template's own, unknown)
        messages = conv.messages if own else self._generic(conv)
        if p.system_prompt and messages[0]["role"] != "system":
            msgs.append({"role": "system", "content": [{"type": "text", "text": p.system_prompt}]})
        for m in messages:
            calls = [{"id": text(c["id"]), "type": "function",
                      "function": {"name": text(c["name"]), "arguments": _strings(c["arguments"], text)}}
                     for c in m.get("tool_calls") or ()]
            parts = m["content"]
            if calls and not self._renders_calls and self.tool_format is not None:
                # the calls written as the model writes them, before its text
                parts = [{"type": "text", "text": self.tool_format.write(
                    [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls])},
                    *parts]
                written = {id(parts[0])}
            else:
                written = set()

            def said(part):  # client text through text(); the calls written above are already through it
                return part["text"] if id(part) in written else text(part["text"])

            if p.content_format == "string":  # images written into the text, before it (OpenGVLab's model.chat)
                n = sum(part["type"] == "image" for part in parts)
                joined = "\n".join(said(part) for part in parts if part["type"] == "text")
                out = {"role": m["role"], "content": (p.image_in_text or "") * n + joined}
            else:
                out = {"role": m["role"], "content": [
                    {"type": "text", "text": said(part)} if part["type"] == "text" else {"type": part["type"]}
                    for part in parts]}
            if calls and self._renders_calls:
                out["tool_calls"] = calls
            if m["role"] == "tool":
                out["tool_call_id"], out["name"] = text(m["tool_call_id"]), text(m["name"])
            msgs.append(out)
        return msgs

    def _render(self, template, msgs: list[dict], tools: list[dict] | None = None) -> str:
        extra = {"tools": tools} if tools and self.tool_format is not None and self.tool_format.renders_tools else {}
        try:
            return template.render(messages=msgs, add_generation_prompt=True, **extra, **self.p.template_strings)
        except ValueError:
            raise
        except Exception as e:  # jinja2 undefined / type errors of a template fed content it does not expect
            raise ConversationError(f"cannot render the chat template: {type(e).__name__}: {e}") from None

    def render(self, conv: Conversation) -> list:
        """The rendered conversation as pieces: text, and ("image", i) / ("video", j) where each image's / video's
        prompt text goes, in order. A conversation with a video is rendered with the template the checkpoint's
        processor renders videos with (PromptSpec.video.chat_template; None: the bundle's own), as transformers
        does."""
        p = self.p
        template = self._template
        if conv.videos:
            why = video_refusal(p)
            if why:
                raise ConversationError(why)
            template = self._video_template
        if conv.tools and self.tools_refusal():
            raise ConversationError(self.tools_refusal())
        text = self._render(template, self._template_messages(conv), conv.tools)
        pieces = self._media_pieces(text, conv)
        if self._literal is None or not any(self._literal.search(t) for t in _client_strings(conv)):
            return pieces
        return self._literal_pieces(template, conv, text)

    def _media_pieces(self, text: str, conv: Conversation) -> list:
        """text split at each image's / video's placeholder, their counts checked against conv's."""
        p = self.p
        marks = [(p.image_placeholder, "image")] if p.image_placeholder else []
        if p.video:
            marks.append((p.video.placeholder, "video"))
        found = {kind: 0 for _, kind in marks}
        pieces: list = []
        pattern = "|".join(re.escape(m) for m, _ in marks)
        at = 0
        for hit in re.finditer(pattern, text) if pattern else ():
            kind = dict(marks)[hit.group(0)]
            pieces += [text[at:hit.start()], (kind, found[kind])]
            found[kind] += 1
            at = hit.end()
        pieces.append(text[at:])
        for mark, kind in marks:
            want = len(conv.images) if kind == "image" else len(conv.videos)
            if found[kind] != want:
                raise ConversationError(f"the rendered conversation has {found[kind]} {kind} tokens ({mark}) for "
                                        f"{want} {kind}s: message text must not contain {mark!r}")
        if not p.image_placeholder and conv.images:
            raise ConversationError("this bundle's chat template takes no images")
        return pieces

    def _literal_pieces(self, template, conv: Conversation, text: str) -> list:
        """The pieces of text (the conversation as rendered) with each control-token string that message text wrote
        a Literal piece: the template rendered again with each of them replaced by a sentinel, which must give text
        back when the strings are put back where the sentinels are (a template that reads the strings, testing or
        splitting the text at them, is refused rather than guessed at)."""
        mark = "\ue000"
        while mark in text:  # a sentinel that neither the template nor any message text writes
            mark += "\ue000"
        found: list[str] = []

        def sub(t: str) -> str:
            def one(hit):
                found.append(hit.group(0))
                return f"{mark}{len(found) - 1}{mark}"
            return self._literal.sub(one, t)

        marked = self._render(template, self._template_messages(conv, sub), _strings(conv.tools, sub))
        sentinel = re.compile(f"{mark}(\\d+){mark}")
        back = sentinel.sub(lambda h: found[int(h.group(1))] if int(h.group(1)) < len(found) else h.group(0), marked)
        if back != text:
            shown = ", ".join(sorted(set(found)))[:80]
            raise ConversationError(f"message text holds control tokens ({shown}) that this chat template reads; they "
                                    "are taken as plain text only where the template copies the text as it is "
                                    "(--allow-special-tokens takes them as tokens)")
        out: list = []
        for x in self._media_pieces(marked, conv):
            if not isinstance(x, str):
                out.append(x)
                continue
            at = 0
            for h in sentinel.finditer(x):
                out += [x[at:h.start()], Literal(found[int(h.group(1))])]
                at = h.end()
            out.append(x[at:])
        return [x for x in out if not isinstance(x, str) or x]


def _strings(x, f):
    """x (JSON-like: dicts, lists, strings, numbers) with f applied to every string in it, keys included."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, list):
        return [_strings(v, f) for v in x]
    if isinstance(x, dict):
        return {_strings(k, f): _strings(v, f) for k, v in x.items()}
    return x


def _client_strings(conv: Conversation):
    """Every string of the client's that the template writes: message text, tool definitions, calls, call ids."""
    found: list[str] = []
    _strings([conv.tools or [], [[m.get("tool_calls") or [], m.get("tool_call_id") or "", m.get("name") or "",
                                  [part.get("text") or "" for part in m["content"]]] for m in conv.messages]],
             lambda t: found.append(t) or t)
    return found


def load_messages(path: str) -> list[dict]:
    """A conversation file: a JSON list of messages (or {"messages": [...]}, as OpenAI requests have)."""
    import json

    try:
        with open(path, encoding="utf-8-sig") as f:  # a UTF-8 BOM (Windows editors and PowerShell write one) is skipped
            data = json.load(f)
    except OSError as e:
        raise ConversationError(f"cannot read {path}: {e.strerror or e}") from None
    except RecursionError:
        raise ConversationError(f"{path} is not JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ConversationError(f"{path} is not JSON: {e}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    parse_messages(data)  # checked here, so that a bad file fails before the model loads
    return data
