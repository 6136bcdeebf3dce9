"""Conversations: OpenAI-style chat messages -> the prompt text, rendered by the checkpoint's own chat template.

    conv = parse_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://.../cat.jpg"}},
        {"type": "text", "text": "What is this?"}]}])
    text = ChatTemplate(manifest.prompt).render(conv, grids)   # grids: (rows, cols, tiles) per image, in order

The manifest carries the template (PromptSpec.chat_template) and how it takes content; it is rendered with jinja2
the way transformers' apply_chat_template does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols), so that
position-dependent template logic (a default system turn, "User:" vs "User: " before an image) comes out as the
reference's. Each rendered image placeholder is then replaced, in order, by the image's expansion
(runtime/prompt.py's host ops), as the processors do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..manifest import PromptSpec
from .prompt import EXPANSION

ROLES = ("system", "user", "assistant")


class ConversationError(ValueError):
    pass


def template_env():
    """A Jinja environment set up like transformers' chat-template rendering."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env


@dataclass
class Conversation:
    """Messages with content as parts: {"type": "text", "text": ...} or {"type": "image", "index": i}, images[i]
    being the image's source (a path, URL, data URI or PIL image)."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)


def user_turn(prompt: str, images: list) -> list[dict]:
    """One user message: the images in order, then the text (what `vlmrt run --image ... --prompt` asks)."""
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": prompt}]}]


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


def parse_messages(messages) -> Conversation:
    """Check and normalize chat messages (OpenAI style); the last one is the user's turn to answer."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("messages must be a non-empty list of {role, content} objects")
    out, images = [], []
    for i, m in enumerate(messages):
        where = f"message {i + 1}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConversationError(f"{where}: needs a role of {', '.join(ROLES)}")
        content = m.get("content")
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
                else:
                    raise ConversationError(f"{where}, part {j + 1}: type must be text, image_url or image")
        else:
            raise ConversationError(f"{where}: content must be a string or a list of parts")
        out.append({"role": m["role"], "content": parts})
    if out[-1]["role"] != "user":
        raise ConversationError("the last message must be the user's (the answer is the next assistant turn)")
    return Conversation(out, images)


class ChatTemplate:
    """A bundle's chat template, compiled once."""

    def __init__(self, p: PromptSpec):
        self.p = p
        try:
            self._template = template_env().from_string(p.chat_template)
        except Exception as e:  # jinja2 syntax errors
            raise ConversationError(f"cannot compile the bundle's chat template: {e}") from None

    def _template_messages(self, conv: Conversation) -> list[dict]:
        p, msgs = self.p, []
        if p.system_prompt and conv.messages[0]["role"] != "system":
            msgs.append({"role": "system", "content": [{"type": "text", "text": p.system_prompt}]})
        for m in conv.messages:
            if p.content_format == "string":  # images written into the text, before it (OpenGVLab's model.chat)
                n = sum(part["type"] == "image" for part in m["content"])
                text = "\n".join(part["text"] for part in m["content"] if part["type"] == "text")
                msgs.append({"role": m["role"], "content": (p.image_in_text or "") * n + text})
            else:
                msgs.append({"role": m["role"], "content": [
                    {"type": "text", "text": part["text"]} if part["type"] == "text" else {"type": "image"}
                    for part in m["content"]]})
        return msgs

    def render(self, conv: Conversation, grids: list[tuple[int, int, int]]) -> str:
        """The prompt text with each image's expansion; grids: (rows, cols, tiles) per image, in order."""
        p = self.p
        if p.expansion not in EXPANSION:
            raise ValueError(f"this vlmrt has no prompt expansion op {p.expansion!r}; upgrade vlmrt")
        try:
            text = self._template.render(messages=self._template_messages(conv), add_generation_prompt=True,
                                         **p.template_strings)
        except ValueError:
            raise
        except Exception as e:  # jinja2 undefined / type errors of a template fed content it does not expect
            raise ConversationError(f"cannot render the chat template: {type(e).__name__}: {e}") from None
        pieces = text.split(p.image_placeholder) if p.image_placeholder else [text]
        if len(pieces) - 1 != len(grids):
            raise ConversationError(f"the rendered conversation has {len(pieces) - 1} image tokens "
                                    f"({p.image_placeholder}) for {len(grids)} images: message text must not contain "
                                    f"{p.image_placeholder!r}")
        out = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            out += EXPANSION[p.expansion](*grid, p) + piece
        return out


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
