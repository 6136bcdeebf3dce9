"""The caches of a conversation: which prompt rows the KV cache holds, and image embeddings by content.

PrefixCache  remembers what a sequence's cache rows stand for: one key per row (runtime/prompt/chunks.py Prompt.keys:
             the token id, or for an image token (image digest, tiling, row) — the image token id alone does not
             say which picture it is). A new
             prompt's keys are compared with them; the cache row (CacheRow.reusable) says how much of the common prefix
             can be kept so that the answer is the one a fresh run gives. The rows themselves stay where they are
             (KVCache.rewind): the prefix cache adds no memory beyond its keys.
ImageCache   encoded images by (content digest, tiling): each image's own record (runtime/prompt/chunks.py ImageChunk, its
             embeddings set, its pixels dropped), least recently used dropped first, bounded in its embeddings' bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from ..prompt.chunks import ImageChunk
from .kv_cache import KVCache


def common_prefix(a: list, b: list) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

class PrefixCache:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: list = []
        self.epoch = -1

    def common(self, keys: list) -> int:
        """How many leading keys equal those of the rows the cache still holds (0 once anything reset it)."""
        if self.epoch != self.cache.epoch:
            return 0
        return common_prefix(self.keys[: self.cache.length], keys)

    def record(self, keys: list) -> None:
        """After a call: keys of the rows 0..cache.length-1 (the prompt's, then the fed generated tokens')."""
        self.keys = list(keys[: self.cache.length])
        self.epoch = self.cache.epoch

    def clear(self) -> None:
        self.keys, self.epoch = [], -1


class ImageCache:
    """Embeddings by key, at most max_bytes of arrays in all (an image larger than that is not kept)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("image cache size must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple, ImageChunk] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> ImageChunk | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: tuple, item: ImageChunk) -> None:
        if key in self._items:
            self.bytes -= self._items.pop(key).embeds.nbytes
        if item.embeds.nbytes > self.max_bytes:
            return
        while self._items and self.bytes + item.embeds.nbytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1].embeds.nbytes
        self._items[key] = item
        self.bytes += item.embeds.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0
