"""Prompt building: the rendered chat template's pieces + each image's expansion (named host ops) -> typed chunks.

    # pieces: the rendered text split at each image; images: each image's ImageChunk, in order
    prompt = build(pieces, images, manifest.prompt, tokenizer, image_token_id)

There is one way a prompt is built, for every caller (run, chat, serve, batch, eval, bench, calibration): the
checkpoint's chat template rendered with jinja2 (runtime/prompt/conversation.py ChatTemplate), each image placeholder
replaced by the image's expansion text, the whole text tokenized once (so token boundaries are those of the
reference processor's), then cut into chunks (runtime/prompt/chunks.py) at the expansions' character spans: each image's
ImageChunk, made when the image was read, is placed there (its ids and rows written on it), the text between becomes
text chunks. A Literal
piece (a control token's string that message text wrote: runtime/prompt/conversation.py) is the one exception: the tokens
the whole text gave it are replaced by its tokens as plain text (special tokens off), those around it kept.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ...format.manifest import PromptSpec
from .chunks import Chunk, ImageChunk, Prompt, TextChunk
from .conversation import Literal


def grid_markers(rows: int, cols: int, tile_tokens: list[int], p: PromptSpec) -> str:
    """SmolVLM / Idefics3: per tile `<fake><row_r_col_c><image>×n`, a newline per grid row,
    then the global tile `\\n<fake><global-img><image>×n<fake>`; a lone global tile when rows == cols == 0."""
    fake, image, glob = p.params["fake_token"], p.params["image_token"], p.params["global_token"]
    if rows == 0 and cols == 0:
        return f"{fake}{glob}{image * tile_tokens[0]}{fake}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += fake + p.params["tile_marker"].format(row=r + 1, col=c + 1) + image * tile_tokens[r * cols + c]
        text += "\n"
    return text + f"\n{fake}{glob}{image * tile_tokens[-1]}{fake}"


def wrapped_run(rows: int, cols: int, tile_tokens: list[int], p: PromptSpec) -> str:
    """InternVL: `<img>` + `<IMG_CONTEXT>` × (every tile's tokens) + `</img>`; Qwen2-VL / Qwen2.5-VL / Qwen3-VL:
    `<|vision_start|>` + `<|image_pad|>` × the image's tokens (one per merge block) + `<|vision_end|>`."""
    return p.params["start_token"] + p.params["image_token"] * sum(tile_tokens) + p.params["end_token"]


def tile_markers(rows: int, cols: int, tile_tokens: list[int], p: PromptSpec) -> str:
    """LFM2-VL (Lfm2VlProcessor._build_image_tokens): `<|image_start|>`, per tile of a rows×cols grid
    `<|img_row_R_col_C|>` + `<image>` × its tokens, then the thumbnail `<|img_thumbnail|>` + `<image>` × its tokens
    when the tiling made one (one tile more than the grid), `<|image_end|>`; a single image (rows == cols == 0) is
    its `<image>` run alone between start and end. Its tiles' token counts differ: a 512² tile has 256, the
    thumbnail or a single image (h/32)·(w/32)."""
    image, out = p.params["image_token"], p.params.get("start_token", "")
    if rows * cols == 0:
        return out + image * tile_tokens[0] + p.params.get("end_token", "")
    for i in range(rows * cols):
        out += p.params["tile_marker"].format(row=i // cols + 1, col=i % cols + 1) + image * tile_tokens[i]
    if len(tile_tokens) > rows * cols:
        out += p.params["thumbnail_token"] + image * tile_tokens[-1]
    return out + p.params.get("end_token", "")


# prompt.expansion -> (rows, cols, tile_tokens: each tile's image-token count, PromptSpec) -> the image's text
EXPANSION = {"grid_markers": grid_markers, "wrapped_run": wrapped_run, "tile_markers": tile_markers}


def expansion(p: PromptSpec):
    if p.expansion not in EXPANSION:
        raise ValueError(f"this vlmrt has no prompt expansion op {p.expansion!r}; upgrade vlmrt")
    return EXPANSION[p.expansion]


def build(pieces: list, media: list[ImageChunk], p: PromptSpec, tokenizer, image_token_id: int) -> Prompt:
    """The prompt as chunks. pieces: text (str) and, in order, one None per image where the template put it (the
    text around it may also come from a video's frame lines); media: each image's chunk, one per None, placed here
    (its ids, rows and tile_tokens written: the same for every prompt it is placed in)."""
    if sum(x is None for x in pieces) != len(media):
        raise ValueError(f"the prompt has {sum(x is None for x in pieces)} image places for {len(media)} images")
    expand = expansion(p)
    text, spans, literal, it = "", [], [], iter(media)
    for x in pieces:
        if x is None:
            m = next(it)
            a = len(text)
            mp = p if m.expansion_params is None else dataclasses.replace(p, params={**p.params, **m.expansion_params})
            text += expand(m.grid[0], m.grid[1], m.tokens(p), mp)
            spans.append((a, len(text), m))
        else:
            if isinstance(x, Literal) and x:
                literal.append((len(text), len(text) + len(x)))
            text += x
    enc = tokenizer.encode(text, add_special_tokens=p.add_special_tokens)
    ids, offsets = enc.ids, enc.offsets
    if literal:
        ids, offsets = as_plain_text(tokenizer, text, ids, offsets, literal)
    n = len(ids)

    def in_text(i: int) -> bool:  # tokens the post-processor adds (BOS, ...) have an empty span
        return offsets[i][1] > offsets[i][0]

    chunks: list[Chunk] = []
    at = 0  # the first token not yet in a chunk
    for a, b, m in spans:
        first = at
        while first < n and not (in_text(first) and offsets[first][0] >= a):
            first += 1
        last = first
        while last < n and in_text(last) and offsets[last][1] <= b:
            last += 1
        run = ids[first:last]
        rows = np.flatnonzero(np.asarray(run, dtype=np.int64) == (image_token_id if m.token_id is None else m.token_id))
        want = sum(m.tokens(p))
        if not run or offsets[first][0] != a or offsets[last - 1][1] != b or len(rows) != want:
            raise ValueError(f"{m.label}: its expansion does not tokenize into its own tokens with {want} image tokens "
                             f"(found {len(rows)}); the tokenizer does not keep the image tokens whole")
        if first > at:
            chunks.append(TextChunk(ids[at:first]))
        m.ids, m.rows, m.tile_tokens = run, rows, m.tokens(p)
        chunks.append(m)
        at = last
    if at < n:
        chunks.append(TextChunk(ids[at:]))
    return Prompt(chunks)


_PLAIN: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, its copy that tokenizes special tokens as text)
_PLAIN_LOCK = threading.Lock()


def plain_tokenizer(tokenizer):
    """A copy of tokenizer with encode_special_tokens on (what transformers' split_special_tokens=True sets): its
    special added tokens' strings are tokenized as text. Made on first use (the tokenizer's JSON parsed again:
    0.5 s for Qwen's 151k-token vocabulary) and kept; the tokenizer itself is shared (a server's slots) and not
    changed."""
    with _PLAIN_LOCK:
        hit = _PLAIN.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(tokenizer.to_str())
            copy.encode_special_tokens = True
            hit = _PLAIN[id(tokenizer)] = (tokenizer, copy)
        return hit[1]


def as_plain_text(tokenizer, text: str, ids: list[int], offsets: list, literal: list[tuple[int, int]]):
    """(ids, offsets) of text with the tokens over the literal character spans replaced by those characters'
    tokens as plain text: each run of tokens that overlaps a span (the control token, and the whitespace an lstrip /
    rstrip token takes with it) gives way to the plain tokens of the characters it covers; the tokens around it
    are kept as they are, so text without a literal span tokenizes as it always did."""
    plain = plain_tokenizer(tokenizer)
    spans = iter(literal)
    span = next(spans, None)
    out_ids, out_offsets, run = [], [], []

    def flush():
        if run:
            lo, hi = offsets[run[0]][0], offsets[run[-1]][1]
            enc = plain.encode(text[lo:hi], add_special_tokens=False)
            out_ids.extend(enc.ids)
            out_offsets.extend((a + lo, b + lo) for a, b in enc.offsets)
            run.clear()

    for i, (a, b) in enumerate(offsets):
        while span is not None and span[1] <= a:
            span = next(spans, None)
        if b > a and span is not None and a < span[1] and b > span[0]:  # in the text, over a literal span
            run.append(i)
            continue
        flush()
        out_ids.append(ids[i])
        out_offsets.append((a, b))
    flush()
    return out_ids, out_offsets


def text_prompt(p: PromptSpec, tokenizer, text: str) -> Prompt:
    """One user turn of text only, as every caller builds it (GPTQ calibration at export, before a bundle exists)."""
    from .conversation import ChatTemplate, parse_messages, user_turn

    return build(ChatTemplate(p).render(parse_messages(user_turn(text, []))), [], p, tokenizer, -1)
