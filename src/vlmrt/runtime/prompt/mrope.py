"""M-RoPE prompt positions (Qwen2-VL / Qwen2.5-VL / Qwen3-VL's `get_rope_index`, images only), numpy only.

A prompt's positions are 3 rows (temporal, height, width) per token. Text tokens take the running position in all
three rows. An image's tokens (one per merge block, raster order over its (h / merge) × (w / merge) block grid) take
t = start, h = start + block row, w = start + block column; the text after it continues at start + max(h, w) / merge,
so positions run behind cache slots after every image, and a decode step's position is the prompt's largest + 1
(+ 1 per token since), transformers' `rope_deltas`.

The runtime gives each image's run of image tokens from its prompt chunk (runtime/prompt/positions.py: the chunk's offset
and image-token rows, mrope_rows); mrope_positions finds them in a list of ids instead (runs of consecutive image
tokens, each holding exactly its grid's token count: the chat template puts <|vision_start|> / <|vision_end|> around
each, so two images never touch), as transformers' get_rope_index does (tests/test_qwen_language.py holds them equal).
"""

from __future__ import annotations

import numpy as np


def image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of image tokens in ids."""
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def mrope_positions(ids, grids: list[tuple[int, int, int]], image_token_id: int, merge: int,
                    start: int = 0) -> np.ndarray:
    """[3, len(ids)] int64 positions of a prompt (or of its part from position `start` on) whose images have
    the processor's grids (t, h, w) in patches, in order."""
    ids = np.asarray(ids, dtype=np.int64)
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"the prompt holds {len(runs)} runs of image tokens for {len(grids)} images")
    return mrope_rows(len(ids), runs, grids, merge, start)


def mrope_rows(n: int, runs: list[tuple[int, int]], grids: list[tuple[int, int, int]], merge: int,
               start: int = 0) -> np.ndarray:
    """[3, n] int64 positions of n tokens whose images' tokens are the slots runs[i] = (first, end), in order, of the
    processor's grids (t, h, w) in patches; every other slot is text."""
    out = np.empty((3, n), np.int64)
    pos, at = start, 0
    for (a, b), (t, h, w) in zip(runs, grids):
        if t != 1:
            raise ValueError(f"an image grid has t = {t}; only still images (t = 1) have M-RoPE positions here")
        bh, bw = h // merge, w // merge
        if b - a != bh * bw:
            raise ValueError(f"an image of {bh}x{bw} tokens has {b - a} image tokens in the prompt")
        out[:, at:a] = pos + np.arange(a - at)  # the text before it
        pos += a - at
        out[0, a:b] = pos
        out[1, a:b] = pos + np.repeat(np.arange(bh), bw)
        out[2, a:b] = pos + np.tile(np.arange(bw), bh)
        pos += max(bh, bw)
        at = b
    out[:, at:] = pos + np.arange(n - at)
    return out


def next_position(positions: np.ndarray) -> int:
    """The position the token after these comes at (all three rows): the largest + 1."""
    return int(positions.max()) + 1 if positions.size else 0
