"""A prompt's decoder embeddings made one prefill block at a time (what the scheduler's Sequence holds).

    rows = PromptRows(prompt, embed, start)   # embed: ids -> [n, hidden] token embeddings (TokenEmbedding.embed)
    len(rows), rows.shape                     # the prompt's slots from start on
    rows[b:e]                                 # [e - b, hidden]: the token rows of those slots, image rows spliced in

Bit for bit what prompt.splice(embed(prompt.ids[start:]), start)[b:e] is (a token's row does not depend on its
neighbours), without holding the whole prompt's float rows while it prefills: 4000 tokens of a 576-wide decoder
are 9.2 MB of float32, resident beside the cache at the prefill's end (the process's peak; docs/performance.md
"Memory at 4000 tokens"). Image rows stay with their chunks (the image cache keeps them anyway)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .chunks import Prompt


class PromptRows:
    def __init__(self, prompt: Prompt, embed: Callable[[list[int]], np.ndarray], start: int = 0):
        self.prompt, self.embed, self.start = prompt, embed, start
        self._images = list(prompt._image_slots(start))  # (checks now that every image chunk has its rows)
        first = embed(prompt.ids[start:start + 1])  # (the width and dtype the blocks will have)
        self.shape, self.dtype = (prompt.n_tokens - start, first.shape[1]), first.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, s: slice) -> np.ndarray:
        b, e, step = s.indices(len(self))
        if step != 1:
            raise IndexError("PromptRows takes a contiguous slice")
        lo, hi = self.start + b, self.start + max(b, e)
        out = self.embed(self.prompt.ids[lo:hi])
        if not out.flags.writeable:
            out = out.copy()
        for _, c, slots, keep in self._images:
            here = keep & (slots >= lo) & (slots < hi)
            if here.any():
                out[slots[here] - lo] = c.embeds[here, : out.shape[1]]
        return out
