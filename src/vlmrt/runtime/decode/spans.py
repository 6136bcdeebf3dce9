"""Prompt blocks that never split a span (manifest decoder.span_input: a run of image-token rows whose rows see each
other both ways on some layers, Gemma 4's bidirectional vision attention; the graph opens a span's later rows only
inside a step, so a step must hold the rest of every span it starts).

    spans = prompt_spans(is_image)        # [n] int64: each row's span (a run of image rows), -1 for the others
    end = block_end(spans, b, ar, n)      # where the prompt block from row b ends

A block ends at b + ar, unless that cuts a span: then before the span where it starts inside the block, else (the
block starts in it: a span longer than ar) at the span's end, so a block may be longer than ar. The plan depends on
the rows from b on only, so a prompt resumed at one of its block starts cuts as a fresh one does (CacheRow.reusable).
"""

from __future__ import annotations

import numpy as np


def prompt_spans(is_image: np.ndarray) -> np.ndarray:
    """[n] bool (an image-token row) -> [n] int64: each maximal run of image rows numbered from 0, -1 elsewhere
    (transformers' get_block_sequence_ids_for_mask)."""
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1).astype(np.int64)


def block_end(spans: np.ndarray | None, b: int, ar: int, n: int) -> int:
    """The end of the prompt block from row b (module doc); spans None: b + ar (at most n)."""
    e = min(n, b + ar)
    if spans is None or e >= n or spans[e] < 0 or spans[e] != spans[e - 1]:
        return e
    span = spans[e]
    s = e
    while s > b and spans[s - 1] == span:
        s -= 1
    if s > b:
        return s
    while e < n and spans[e] == span:
        e += 1
    return e
