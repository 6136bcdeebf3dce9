"""The host's token table [vocab, row width] as row blocks, never whole in memory.

A family's `load_weights` gives the table either as a torch tensor (a table small enough to hold) or as a
`TokenTable` of parts side by side, each a checkpoint tensor as stored (safetensors maps its files: a row block read
from it is page cache until converted) times a scale: Gemma 4's token embedding × sqrt(hidden) beside its per-layer
table × sqrt(per_layer) (262,144 × (1536 + 35 × 256) values at E2B: 11 GB as float32). The exporter writes the
bundle's table block by block (export/pipeline.py) and the calibrations read the rows of their prompts
(`table[ids]`); a block is converted to float32 as the whole table was (`source.float() * scale`, the scale a
float32 scalar), so the rows are bit-equal to the table computed whole.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

BLOCK_BYTES = 64 << 20  # float32 bytes per row block: one block converted at a time


class TokenTable:
    """[vocab, sum of the parts' widths]: row r is the parts' rows r, each as float32 times its scale, side by side.
    parts: (source [>= vocab rows, width], scale or None); a source with more rows than vocab is read up to vocab."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, float | None]], vocab: int):
        for source, _ in parts:
            if source.dim() != 2 or source.shape[0] < vocab:
                raise ValueError(f"a token table part of shape {tuple(source.shape)} has fewer than {vocab} rows")
        self.parts = list(parts)
        self.shape = (vocab, sum(int(s.shape[1]) for s, _ in self.parts))

    @classmethod
    def of(cls, table: torch.Tensor) -> "TokenTable":
        """A table held whole (the families whose table is their token embedding)."""
        return cls([(table, None)], int(table.shape[0]))

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1, float32 [stop - start, width]."""
        return self._convert(lambda source: source[start:stop])

    def __getitem__(self, ids) -> np.ndarray:
        """The rows of the token ids (a list or an int array), float32 [len(ids), width]."""
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        return self._convert(lambda source: source.index_select(0, index))

    def blocks(self, block_bytes: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows float32) over the table, block_bytes (default BLOCK_BYTES) of float32 at a time."""
        step = max(1, (block_bytes or BLOCK_BYTES) // (4 * self.shape[1]))
        for start in range(0, self.shape[0], step):
            yield start, self.rows(start, min(start + step, self.shape[0]))

    def _convert(self, pick) -> np.ndarray:
        out = []
        for source, scale in self.parts:
            x = pick(source).float()
            if scale is not None:
                x = x * torch.tensor(scale, dtype=torch.float32)
            out.append(x)
        return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).numpy()
