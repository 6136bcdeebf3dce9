"""Gemma 4's two layer states beside the attention state (runtime/decode/state_kinds.py), registered by name:

  sliding_attention  a sliding-window layer (manifest SlidingAttentionLayer: a query at slot q sees the keys at slots
                     q - window < k <= q). Its K and V rows are kept one per slot, as an attention layer's, and the
                     graph applies the window (GroupQueryAttention's local_window_size; under the rows kinds, added
                     to the kind's mask in the graph). Why not a ring of `window` slots: a ring overwrites slot s - window when it writes slot s, and every rewind the runtime
                     makes needs rows older than that back: a prefix reuse keeps slots 0..n-1 of an earlier answer
                     and attends from slot n over n - window..n - 1, which that answer's later writes would have
                     overwritten; a verify call's rejected drafts would have evicted rows the accepted prefix still
                     sees. Rows by slot make every rewind a move of the length, exact whatever was written after,
                     and keep gqa_in_place's contract (the op writes a step's rows at its slots, batched calls
                     included). ORT 1.32's window-sized GroupQueryAttention buffers (sliding_window_cache) bound the
                     memory instead, but compact their rows in groups as they go, so a rollback by k is exact only
                     where no compaction happened in the last k tokens (docs/adding-a-family.md: not taken).
  shared_kv          a layer that reads an earlier layer's K and V (manifest SharedKVLayer.source) inside the graph:
                     no state, no graph input or output of its own; nothing to store, load or rewind.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ...format.manifest import SharedKVLayer
from .cache_layouts import CacheLayout
from .state_kinds import AttentionState, register_state


@register_state
class SlidingAttentionState(AttentionState):
    """An attention state (blocks by shape, bound and stored by the layout) of the sliding-window layers: the window
    is the graph's, so storing, rewinding and batching are the attention state's."""

    name = "sliding_attention"

    @staticmethod
    def _own(enc: dict) -> dict:
        """A uint8 cache's encodings of these layers: kv.encodings' "sliding_key" / "sliding_value" lists
        (export/cache_kinds.py), apart from the attention layers' "key" / "value"."""
        return {"key": enc.get("sliding_key", []), "value": enc.get("sliding_value", [])}

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        super().clear_unused(self._own(enc), n, end)

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        super().requantize(self._own(src), self._own(dst), n)


@register_state
class SharedKVState:
    name = "shared_kv"
    batch_axis = 0
    loads_inputs = False
    stores = False
    drops_rows = True  # (no rows of its own: its source's are per slot)

    def __init__(self, layers: list[tuple[int, SharedKVLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        self.indices = [index for index, _ in layers]

    @staticmethod
    def batch_arrays(layers, layout: CacheLayout, max_context: int, n: int, dtype) -> list[np.ndarray]:
        return []

    arrays: list[np.ndarray] = []
    nbytes = 0

    def inputs(self) -> list:
        return []

    def staging(self, ar: int) -> list[np.ndarray]:
        return []

    def bind(self, bind, bind_output, ctx: int, staged: list[np.ndarray]) -> None:
        pass

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        pass

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        pass

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        pass

    @staticmethod
    def check_graph(layers, g, graph: str, layout: CacheLayout, max_context: int, ctx: int | None, kind: str) -> None:
        """Nothing of its own in the graph; the source layer's inputs are checked as that layer's."""

