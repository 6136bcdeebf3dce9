"""Render a model's Jinja chat template once, at export, into the manifest's prompt templates.

Single-turn prompts fill `{image}` and `{prompt}` in the rendered strings; conversations render the template
itself, which the manifest carries too (runtime/conversation.py). We render
the template like transformers does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols) for a
single user turn with a generation prompt, with sentinels where the image and text go.
"""

from __future__ import annotations

from typing import Any

from ..runtime.conversation import template_env

TEXT_SENTINEL = "\x00VLMRT_PROMPT\x00"


def render(template: str, messages: list[dict[str, Any]], special: dict[str, str]) -> str:
    try:
        return template_env().from_string(template).render(messages=messages, add_generation_prompt=True, **special)
    except ValueError:
        raise
    except Exception as e:  # jinja2 syntax/undefined errors, or a template that expects other content types
        raise ValueError(f"cannot render the chat template: {type(e).__name__}: {e}") from None


def prompt_templates(template: str, image_placeholder: str, special: dict[str, str], system: str | None = None,
                     image_in_text: str | None = None) -> tuple[str, str]:
    """(template_image, template_text) with `{image}` / `{prompt}` markers.

    image_placeholder is what the template writes for an image item (e.g. "<image>"), which the
    runtime's expansion op replaces with the expanded image text. Templates that only know string
    content (the original InternVL ones) get the image as text: image_in_text + prompt (e.g. "<image>\n").
    """
    if image_in_text is None:
        sys_msgs = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
        image_msg = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT_SENTINEL}]}
        text_msg = {"role": "user", "content": [{"type": "text", "text": TEXT_SENTINEL}]}
    else:
        sys_msgs = [{"role": "system", "content": system}] if system else []
        image_msg = {"role": "user", "content": image_in_text + TEXT_SENTINEL}
        text_msg = {"role": "user", "content": TEXT_SENTINEL}
    with_image = render(template, sys_msgs + [image_msg], special)
    text_only = render(template, sys_msgs + [text_msg], special)
    if with_image.count(TEXT_SENTINEL) != 1 or with_image.count(image_placeholder) != 1 or text_only.count(TEXT_SENTINEL) != 1:
        raise ValueError("the chat template does not render one image and one text item as expected")
    for s in (with_image, text_only):
        if "{prompt}" in s or "{image}" in s:
            raise ValueError("the chat template contains a literal {prompt} or {image}")
    with_image = with_image.replace(image_placeholder, "{image}").replace(TEXT_SENTINEL, "{prompt}")
    return with_image, text_only.replace(TEXT_SENTINEL, "{prompt}")
