"""Check at export that the checkpoint's Jinja chat template renders a user turn of an image and a text as the
runtime will render conversations (runtime/prompt/conversation.py), and pick how it takes content.

Templates that take content as parts ({"type": "image"}, {"type": "text"}) get images where they write the image
placeholder; templates that only know string content (the original InternVL ones) get each image as text before
the message's text (image_in_text, e.g. "<image>\\n"), as OpenGVLab's model.chat writes it.
"""

from __future__ import annotations

from ..runtime.prompt.conversation import ChatTemplate, ConversationError, parse_messages

TEXT_SENTINEL = "\x00VLMRT_PROMPT\x00"


def renders_one_image(spec) -> bool:
    """Whether spec's template renders a user turn of one image and one text with one placeholder and the text."""
    conv = parse_messages([{"role": "user", "content": [{"type": "image", "image": "x"},
                                                        {"type": "text", "text": TEXT_SENTINEL}]}])
    try:
        pieces = ChatTemplate(spec).render(conv)
    except (ValueError, ConversationError):
        return False
    text = "".join(x for x in pieces if isinstance(x, str))
    return text.count(TEXT_SENTINEL) == 1 and pieces.count(("image", 0)) == 1
