"""The rope positions of a prompt's rows: the one place that computes them (the decoder graphs take them as an input
apart from the cache slots, manifest decoder.positions).

A named host op (POSITION_OPS, by decoder.positions.op) turns a prompt (its typed chunks, runtime/prompt/chunks.py) into
positions [rows, n] int64 for its rows from slot `start` on, given the position the first of them follows (the
cache's next position: KVCache.next_position). Generated tokens need no op: each is one past the largest position
before it (CacheRow.positions), in every rope row.
  slots  one row, position p at slot p for a fresh prompt (Llama, Qwen2 / Qwen3, SmolVLM, InternVL: an image's rows
         are counted like text)
  mrope  3 rows (t, h, w), Qwen2-VL's get_rope_index: text takes the running position in every row; an image chunk's
         image-token rows (its offset in the prompt + its rows: read from the chunk, the ids not scanned again), its
         grid's rows × cols tokens in raster order, take (p, p + row, p + col) and the tokens after them continue at
         p + max(rows, cols) (runtime/prompt/mrope.py). The positions of a prompt's part depend on
         what comes before it only, so they are computed from slot 0 and cut at start (a kept prefix may end inside an
         image).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...format.manifest import PositionsSpec
from .chunks import Prompt
from .mrope import mrope_rows


def slots(spec: PositionsSpec, prompt: Prompt, start: int, first: int) -> np.ndarray:
    """[rows, n_tokens - start]: first, first + 1, ... in every row."""
    n = prompt.n_tokens - start
    return np.broadcast_to(first + np.arange(n, dtype=np.int64), (spec.rows, n))


def mrope(spec: PositionsSpec, prompt: Prompt, start: int, first: int) -> np.ndarray:
    """[3, n_tokens - start]: M-RoPE positions, each image chunk's grid (rows, cols, _) its token grid."""
    if spec.rows != 3:
        raise ValueError(f"the mrope positions op gives 3 rows, the bundle's decoder takes {spec.rows}")
    images = prompt.images()
    if not images:
        return slots(spec, prompt, start, first)
    runs = []
    for o, c in images:
        a, b = o + int(c.rows[0]), o + int(c.rows[-1]) + 1
        if b - a != len(c.rows):
            raise ValueError(f"{c.label}'s image tokens are not one run: M-RoPE positions an image's tokens as a grid")
        runs.append((a, b))
    grids = [(1, c.grid[0], c.grid[1]) for _, c in images]  # (t, h, w) in tokens: merge 1
    return mrope_rows(prompt.n_tokens, runs, grids, 1)[:, start:]


POSITION_OPS: dict[str, Callable[[PositionsSpec, Prompt, int, int], np.ndarray]] = {"slots": slots, "mrope": mrope}


def position_op(spec: PositionsSpec):
    """The bundle's positions op (ValueError, one line, if this vlmrt has none of that name)."""
    op = POSITION_OPS.get(spec.op)
    if op is None:
        raise ValueError(f"this vlmrt has no positions op {spec.op[:40]!r}; upgrade vlmrt")
    return op


def prompt_positions(spec: PositionsSpec, prompt: Prompt, start: int, first: int) -> np.ndarray:
    """The positions of the prompt's slots start.. (the rows a prefill feeds), the first following position `first`."""
    return position_op(spec)(spec, prompt, start, first)
