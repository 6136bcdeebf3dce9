"""Prompt-lookup drafting for lookahead decoding: guess the next tokens by copying what followed the last n-gram
where it occurred before in the prompt or the answer.

    drafter = PromptLookup(k=4, ids=prompt_ids)
    drafts = drafter.propose(limit)   # up to min(k, limit) token ids, or [] (no match, or backing off)
    ...                               # CacheRow.verify: one decoder call over [token, *drafts]
    drafter.feedback(accepted)        # how many drafts the model agreed with
    drafter.append(token)             # every token emitted, in order

The scheduler verifies drafts against the greedy choice of the model at each row, so drafting only decides speed,
never the output. The drafts are looked up in the prompt and in the answer so far: an answer that repeats itself (a
list said again, a second verse) is drafted from its own earlier tokens, the latest occurrence first; a copy that
runs into the sequence's end goes on with what it copied (a period shorter than the draft repeats).

A verify call costs more than a one-token step, and less per row the more rows it has (SmolLM2 w4a16 on 2 cores:
1 + 1, 2, 4, 8, 16 rows cost 2.3, 2.4, 2.6, 3.2, 4.0 one-token steps: MatMulNBits takes its dequantize-and-GEMM
path for more than one row; docs/performance.md). So the draft length adapts: it starts at START, doubles after a
call that accepted every draft (up to k), and falls to the next power of two above what the last call accepted;
drafts are cut to a power of two (LENGTHS: a few verify shapes, each a bound step with its buffers) and at least
MIN_DRAFT long (a call that can gain one token costs more than the token). A call pays from MIN_GAIN accepted
drafts on; misses back off: after a call that accepted fewer, drafting pauses for FIRST_PAUSE, then twice as many
steps each time, up to MAX_PAUSE (a call that accepts MIN_GAIN halves it), so that an answer that copies little pays
for a few calls only. adapt=False (a static verify graph, whose calls cost its AR whatever the drafts) drafts k.
"""

from __future__ import annotations

from ...format.manifest import GraphSpec

NGRAMS = (3,)  # the suffix lengths looked up, longest first (2-grams drafted open answers' coincidences: -8 %)
MIN_GAIN = 2  # accepted drafts that make a verify call a hit
FIRST_PAUSE, MAX_PAUSE = 8, 64  # steps without drafting after the first miss, and at most
START, MIN_DRAFT = 4, 2  # the first draft length, and the shortest draft worth a verify call (adapt=True)


class PromptLookup:
    def __init__(self, k: int, ids: list[int], adapt: bool = True):
        self.k = k
        self.adapt = adapt
        self.length = min(k, START) if adapt else k  # the draft length now
        self.ids: list[int] = []
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in NGRAMS}  # n -> n-gram -> where its follower is
        self.pause = 0  # steps to wait after the next miss
        self.wait = 0  # steps left without drafting
        for t in ids:
            self.append(t)

    def append(self, token: int) -> None:
        """token is the next id of the sequence: the n-grams just before it now have it as their latest follower."""
        i = len(self.ids)
        self.ids.append(int(token))
        for n, where in self.index.items():
            if i >= n:
                where[tuple(self.ids[i - n : i])] = i

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) ids that followed the latest earlier occurrence of the sequence's last n ids."""
        if self.wait:
            self.wait -= 1
            return []
        k = min(self.length, limit)
        if k <= 0:
            return []
        for n, where in self.index.items():
            at = where.get(tuple(self.ids[-n:]))
            if at is not None:
                drafts = self.ids[at : at + k]
                while len(drafts) < k:  # the copy ran into the sequence's end: what followed it then follows again
                    drafts += self.ids[at : at + k - len(drafts)]
                if not self.adapt:
                    return drafts
                if len(drafts) < min(MIN_DRAFT, self.k):
                    return []
                return drafts[: 1 << (len(drafts).bit_length() - 1)]  # a power of two: few verify shapes
        return []

    def feedback(self, accepted: int, drafted: int) -> None:
        """accepted of drafted drafts the model agreed with: the next draft length and the back-off."""
        if self.adapt:
            self.length = min(self.k, 2 * self.length if accepted == drafted else max(START, 1 << accepted.bit_length()))
        if accepted >= MIN_GAIN:
            self.pause //= 2  # a hit halves the back-off: consecutive hits end it, a lone hit among misses does not
        else:
            self.pause = min(MAX_PAUSE, 2 * self.pause or FIRST_PAUSE)
            self.wait = self.pause


def check_exact(decode: GraphSpec, k: int) -> None:
    """ValueError if lookahead (k > 0) could change the answer of the decode graph: with int8 activations (the *a8*
    precisions, of its linear layers or its lm head) a verify step's rows come out apart from decode steps' (on
    SmolLM2 w4a8: logits 0.6 apart, answers that part after 12-52 tokens), so a verify step's greedy choice is not the
    plain decode's: its attention takes GroupQueryAttention's multi-token path (row 0 3e-5 from the decode step, on a
    CPU where MatMulNBits computes a row the same in a call of any width) and the int8 activation quantization
    amplifies that (0.2-0.64 by row 4), so no choice of call width (Scheduler.probe) makes it exact.
    Float activations (fp32, fp16, w*a16) agree to ~5e-5."""
    precisions = {decode.precision, str(decode.weights.get("lm_head", ""))}
    inexact = sorted(p for p in precisions if "a8" in p)
    if k and inexact:
        raise ValueError(f"--lookahead needs a decoder with float activations: this bundle's {'/'.join(inexact)} "
                         "computes a multi-token verify step differently from a one-token step, so lookahead would "
                         "change the answer; export with --quant w4a16 (or w8a16, fp16, fp32) to use it")
