"""The rope positions of a prompt's rows: the one place that computes them (the decoder graphs take them as an input
apart from the cache slots, manifest decoder.positions).

A named host op (POSITION_OPS, by decoder.positions.op) turns a prompt's token ids into positions [rows, n] int64
for its rows from slot `start` on, given the position the first of them follows (the cache's next position:
KVCache.next_position). Generated tokens need no op: each is one past the largest position before it
(Engine.positions), in every rope row.
  slots  one row, position p at slot p for a fresh prompt (Llama, Qwen2 / Qwen3, SmolVLM, InternVL: an image's rows
         are counted like text)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..format.manifest import PositionsSpec


def slots(spec: PositionsSpec, ids: list[int], start: int, first: int) -> np.ndarray:
    """[rows, len(ids) - start]: first, first + 1, ... in every row."""
    n = len(ids) - start
    return np.broadcast_to(first + np.arange(n, dtype=np.int64), (spec.rows, n))


POSITION_OPS: dict[str, Callable[[PositionsSpec, list[int], int, int], np.ndarray]] = {"slots": slots}


def position_op(spec: PositionsSpec):
    """The bundle's positions op (ValueError, one line, if this vlmrt has none of that name)."""
    op = POSITION_OPS.get(spec.op)
    if op is None:
        raise ValueError(f"this vlmrt has no positions op {spec.op[:40]!r}; upgrade vlmrt")
    return op


def prompt_positions(spec: PositionsSpec, ids: list[int], start: int, first: int) -> np.ndarray:
    """The positions of ids[start:] (the rows a prefill feeds), the first following position `first`."""
    return position_op(spec)(spec, ids, start, first)
