"""A minimal host for LFM2 decoder graphs in tests, before the runtime's cache kinds run them: the per-slot state of
families/lfm2_vl/language.py (K/V rows per attention layer, conv-input rows per conv layer, slot p = position p), one
write path for both, and the three ways a prompt is fed (kv: 1 row per step; hybrid: blocks; lookahead: a verify
block of which only the accepted rows are written)."""

from __future__ import annotations

import numpy as np

CONTEXT_STEP = 64


class SlotState:
    def __init__(self, layer_types, hidden: int, kv_dim: int, max_context: int, width: int):
        self.kinds, self.width, self.max_context = list(layer_types), width, max_context
        self.buffers = []  # per state input, in the graph's order: [max_context, dim]
        for kind in self.kinds:
            dims = [hidden] if kind == "conv" else [kv_dim, kv_dim]
            self.buffers += [np.zeros((max_context, d), np.float32) for d in dims]
        self.length = 0

    def inputs(self, slot: int, ar: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """(mask [ar, ctx + ar], state inputs) of a step at slots slot..slot+ar-1: K/V prefixes [:ctx], conv windows
        [slot-W, slot) (zeros before slot 0)."""
        ctx = min(self.max_context, max(CONTEXT_STEP, -(-slot // CONTEXT_STEP) * CONTEXT_STEP))
        mask = np.full((ar, ctx + ar), np.finfo(np.float32).min, np.float32)
        mask[:, :slot] = 0
        mask[:, ctx:] = np.triu(np.full((ar, ar), np.finfo(np.float32).min, np.float32), 1)
        out, at = [], 0
        for kind in self.kinds:
            if kind == "conv":
                win = np.zeros((self.width, self.buffers[at].shape[1]), np.float32)
                lo = max(0, slot - self.width)
                win[self.width - (slot - lo):] = self.buffers[at][lo:slot]
                out.append(win)
                at += 1
            else:
                out += [self.buffers[at][:ctx], self.buffers[at + 1][:ctx]]
                at += 2
        return mask, out

    def write(self, slot: int, rows: list[np.ndarray], n: int) -> None:
        """The one update: the first n rows of each state output at slots slot..slot+n-1."""
        for buf, r in zip(self.buffers, rows):
            buf[slot:slot + n] = r[:n]
        self.length = slot + n


def step(run, state: SlotState, embeds: np.ndarray, slot: int, logit_rows=None):
    """One graph call: run(embeds, positions, mask, *state[, logit_rows]) -> (logits, *rows). Returns (logits, rows)."""
    ar = len(embeds)
    mask, past = state.inputs(slot, ar)
    extra = [] if logit_rows is None else [np.asarray(logit_rows, np.int64)]
    logits, *rows = run(embeds.astype(np.float32), np.arange(slot, slot + ar, dtype=np.int64), mask, *past, *extra)
    return logits, rows


def prefill(run, state: SlotState, embeds: np.ndarray, start: int, block: int, logit_rows: bool):
    """Feed embeds (the prompt's rows from slot start) in blocks of `block` rows; the last row's logits."""
    at = start
    logits = None
    while at < start + len(embeds):
        chunk = embeds[at - start:at - start + block]
        logits, rows = step(run, state, chunk, at, [len(chunk) - 1] if logit_rows else None)
        state.write(at, rows, len(chunk))
        at += len(chunk)
    return logits[-1]


def greedy(run, state: SlotState, embed_table: np.ndarray, embeds: np.ndarray, n: int, *, block: int = 1,
           start: int = 0, logit_rows: bool = False) -> list[int]:
    last = prefill(run, state, embeds, start, block, logit_rows)
    ids = [int(np.argmax(last))]
    while len(ids) < n:
        slot = state.length
        logits, rows = step(run, state, embed_table[ids[-1:]], slot, [0] if logit_rows else None)
        state.write(slot, rows, 1)
        ids.append(int(np.argmax(logits[-1])))
    return ids


def lookahead(run, state: SlotState, embed_table: np.ndarray, embeds: np.ndarray, n: int, drafts, *, block: int,
              logit_rows: bool = True) -> tuple[list[int], int]:
    """Greedy decoding where each step verifies the current token + drafts(ids) in one call and writes only the rows
    of the current token and the accepted drafts (runtime/engine.py Engine.verify's rule). Returns (ids, rejected
    rows: rows computed and never written)."""
    ids = [int(np.argmax(prefill(run, state, embeds, 0, block, logit_rows)))]
    rejected = 0
    while len(ids) < n:
        d = list(drafts(ids))[: n - len(ids) - 1]
        slot = state.length
        feed = [ids[-1]] + d
        logits, rows = step(run, state, embed_table[feed], slot, list(range(len(feed))) if logit_rows else None)
        choice = np.argmax(logits, -1)
        k = 0
        while k < len(d) and d[k] == int(choice[k]):
            k += 1
        state.write(slot, rows, 1 + k)
        rejected += len(d) - k
        ids += d[:k] + [int(choice[k])]
    return ids[:n], rejected
