"""Token embeddings: the table's rows by token id, as a prompt's rows or as a decode step's input.

    emb = TokenEmbedding(bundle.embed_table, bundle.embed_scale, np.float32, token_rows=bool(kind.token_rows_input))
    x = emb.embed(ids)                 # [n, hidden] in the decoder's dtype
    emb.into_step(token, buffers)      # a one-row step's input (StepBuffers of AR 1), no allocation
    emb.into_row(token, buffers, r)    # row r of a batched call's inputs (runtime/decode/scheduler.py)

int8 tables under a graph that scales the row itself (decoder.kind.token_rows_input): a decode step reads the token's
int8 row into the graph's input (EmbeddingRows.read_into: pread) and sets its scale, no multiply on the host.
"""

from __future__ import annotations

from array import array

import numpy as np


class TokenEmbedding:
    def __init__(self, table, scale: np.ndarray | None, dtype, token_rows: bool = False):
        """table: [vocab, hidden] rows by token id (an ndarray, or the bundle's EmbeddingRows: pread); scale: [vocab]
        when the table is int8 rows; token_rows: the decoder graph takes an int8 row and its scale per token."""
        # a memmap is indexed as a plain ndarray over the same mapping (np.memmap's __getitem__ is slow)
        self.table = table.view(np.ndarray) if isinstance(table, np.memmap) else table
        self.scale = scale
        self.dtype = np.dtype(dtype)
        self.vocab = self.table.shape[0]
        # one row [hidden] by token id: EmbeddingRows.row (a reused buffer), or a view of the ndarray's row
        self._row = getattr(self.table, "row", self.table.__getitem__)
        self.int8_rows = bool(token_rows and scale is not None and self.table.dtype == np.int8)
        self._read_row = self._scales = None
        if self.int8_rows:
            self._read_row = getattr(self.table, "read_into", None) or _ndarray_reader(self.table)
            self._scales = array("f", np.asarray(scale, np.float32).tobytes())  # [vocab], indexed as floats

    def embed(self, ids: list[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        rows = self.table[ids]
        if self.scale is not None:
            return (rows.astype(np.float32) * self.scale[ids][:, None]).astype(self.dtype)
        return np.asarray(rows, dtype=self.dtype)

    def check(self, token: int) -> None:
        if not 0 <= token < self.vocab:
            raise IndexError(f"token id {token} out of range 0..{self.vocab - 1}")

    def into(self, token: int, out: np.ndarray) -> None:
        """out [hidden] = token's embedding (as embed([token])[0], without its allocations: the decode loop's)."""
        self.check(token)
        row = self._row(token)
        if self.scale is None:
            out[...] = row
        elif out.dtype == np.float32:
            np.multiply(row, self.scale[token], out=out, dtype=np.float32)
        else:
            out[...] = row.astype(np.float32) * self.scale[token]

    def into_step(self, token: int, buffers) -> None:
        """A one-row step's input (StepBuffers of AR 1): the token's row in its first row, or its int8 row and scale."""
        if not self.int8_rows:
            self.into(token, buffers.first_row)
            return
        self.check(token)
        self._read_row(token, buffers.token_row(self._scales[token]))

    def into_row(self, token: int, buffers, r: int, row: np.ndarray | None = None) -> None:
        """Row r of a batched call's inputs (StepBuffers of AR B): the token's row, or its int8 row and scale. row:
        buffers.embeds[r] (a view made once)."""
        if not self.int8_rows:
            self.into(token, buffers.embeds[r] if row is None else row)
            return
        self.check(token)
        self._read_row(token, memoryview(buffers.token_rows[r]))
        buffers.token_scales[r] = self._scales[token]

    def clear_row(self, buffers, r: int) -> None:
        """Row r of a batched call's inputs fed nothing (zeros): an idle row."""
        buffers.embeds[r] = 0
        if self.int8_rows:
            buffers.token_scales[r] = 0


def _ndarray_reader(table: np.ndarray):
    """EmbeddingRows.read_into for an int8 table held as an ndarray."""
    def read_into(token: int, buf) -> None:
        np.frombuffer(buf, np.int8)[...] = table[token]
    return read_into
