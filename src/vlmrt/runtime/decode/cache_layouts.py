"""How a decoder kind lays out its cache state at the graph edge (CacheLayout: ROWS, HEADS), and the zeroed memory a
cache is allocated in. The decoder kind picks the layout (runtime/decode/decoder_kinds.py); each state kind
(runtime/decode/state_kinds.py) shapes, binds and writes its buffers by it."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...format.manifest import AttentionLayer, ConvLayer


def zeroed(shape: tuple, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) in its own anonymous mapping, with huge pages refused (MADV_NOHUGEPAGE): numpy
    advises huge pages for arrays of 4 MB or more, so the first row written into a cache buffer would make the whole
    2 MB around it resident (a 16-token prompt: 42 of a 45 MB cache; docs/performance.md#memory). Here only the pages
    the rows are written to count. np.zeros where mmap has no private anonymous mappings."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None or n == 0:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, n, flags=flags | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)  # the array keeps the mapping alive


@dataclass(frozen=True)
class CacheLayout:
    """How an attention layer's K (or V) buffer is laid out, and whether the graph writes it itself; the decoder kind
    picks one (decoder_kinds.py)."""

    name: str
    shape: Callable[[AttentionLayer, int | None], tuple]  # (layer, cache length) -> one buffer's shape
    rows: Callable[[np.ndarray, int], np.ndarray]  # (block [layers, 2, *buffer], n) -> its slots 0..n-1 [layers, 2, n, dim]
    prefix: bool  # a step reads a buffer's prefix [:ctx] (else the whole buffer)
    # block -> its view [max_context, layers, 2, dim] by slot (a decode step's one-row write), where the host writes
    by_slot: Callable[[np.ndarray], np.ndarray | None]
    window: Callable[[ConvLayer], tuple]  # a conv layer's window shape (its rows': the same with ar for width)
    # the graph updates the attention buffers itself (each bound as input and output; a plain call returns them
    # whole): the host writes no attention rows, a step has no attention staging
    in_place: bool


ROWS = CacheLayout("rows", lambda layer, ctx: (ctx, layer.dim), lambda block, n: block[:, :, :n], True,
                   lambda block: block.transpose(2, 0, 1, 3), lambda layer: (layer.width, layer.channels), False)
HEADS = CacheLayout("heads", lambda layer, ctx: (1, layer.kv_heads, ctx, layer.cache_dim),
                    lambda block, n: block[:, :, 0, :, :n].transpose(0, 1, 3, 2, 4).reshape(*block.shape[:2], n, -1),
                    False, lambda block: None,  # (the graph writes HEADS buffers itself)
                    lambda layer: (1, layer.width, layer.channels), True)
