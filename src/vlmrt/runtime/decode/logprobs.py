"""Log probabilities of the chosen tokens (OpenAI's `logprobs` / `top_logprobs`), from the logits row each token was
picked from: log_softmax of the model's logits as the decoder graph returns them, before temperature, top-k and
top-p (vLLM's default `raw_logprobs`; OpenAI's are the model's too), so a greedy and a sampled answer report the same
distribution.

    entry = token_logprobs(logits_row, token, top=5)   # TokenLogprob(id, logprob, top: the 5 most likely)

Every decoder kind returns whole logits rows ([r, vocab]; the argmax output is beside them, and a head graph maps
a row whole), so this is exact for every bundle; with the re-scored 4-bit head (`lm_head=w4a8r` / `w4a16r`) the row
is that graph's: its top 8 logits from the 8-bit rows, the others the 4-bit head's (export/cpu/rescored_head.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_TOP = 20  # OpenAI's limit on top_logprobs


@dataclass
class TokenLogprob:
    """A token's log probability and, best first, the `top` most likely tokens of the same row with theirs.
    token / bytes: its text, filled in by the tokenizer's side (VLM: TokenBytes); the scheduler gives ids only."""

    id: int
    logprob: float
    top: list["TokenLogprob"] = field(default_factory=list)
    token: str = ""
    bytes: bytes = b""

    def as_dict(self, top: bool = True) -> dict:
        """OpenAI's shape: token, logprob (-inf as -9999.0, as OpenAI and vLLM send it: JSON has no infinity), bytes
        (a list of ints), top_logprobs (top: each in the same shape without its own)."""
        d = {"token": self.token, "logprob": max(self.logprob, -9999.0), "bytes": list(self.bytes)}
        if top:
            d["top_logprobs"] = [t.as_dict(False) for t in self.top]
        return d


def token_logprobs(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """row: one logits row [vocab] (any float dtype); token: the id picked from it; top: how many of the most likely
    ids to list (0..MAX_TOP), best first (ties by the lower id)."""
    x = row if row.dtype == np.float32 else row.astype(np.float32)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))  # (float32 pairwise sums: ~1e-7 of the sum at a 262k vocabulary)
    best = [TokenLogprob(int(i), float(x[i]) - lse) for i in top_ids(x, top)] if top else []
    return TokenLogprob(int(token), float(x[token]) - lse, best)


def top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of x's k largest values, best first (ties by the lower id). Not a partition of the whole row (~0.5 ms
    at a 49k vocabulary): the k-th largest of the maxima of B >= k blocks is a bound t that at least k values reach,
    so the k largest are among the few values >= t (~30 µs)."""
    n = x.size
    blocks = 8 * k
    if n < 4 * blocks:
        cand = np.arange(n)
    else:
        size = n // blocks
        t = np.partition(x[: blocks * size].reshape(blocks, size).max(axis=1), blocks - k)[blocks - k]
        cand = np.flatnonzero(x >= t)
    return cand[np.lexsort((cand, -x[cand]))][:k]
