"""runtime/decode/spans.py: a prompt's image spans (transformers' get_block_sequence_ids_for_mask) and the block plan
that never splits one (a decoder with a span input: Gemma 4's bidirectional vision attention). Fails before the
module existed; guards the plan CacheRow.prefill and the scheduler share."""

import numpy as np

from vlmrt.runtime.decode.spans import block_end, prompt_spans


def plan(spans, ar, n=15):
    out, b = [], 0
    while b < n:
        e = block_end(spans, b, ar, n)
        out.append((b, e))
        b = e
    return out


def test_spans_number_runs_of_image_rows():
    is_image = np.array([0, 1, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    assert prompt_spans(is_image).tolist() == [-1, 0, 0, -1, -1, 1, 1, 1, -1, 2]


def test_blocks_end_before_a_span_they_would_split_or_run_to_its_end():
    spans = prompt_spans(np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0], bool))
    assert plan(spans, 4) == [(0, 2), (2, 6), (6, 13), (13, 15)]  # (the second span, 7 rows, in one block of 7)
    assert plan(None, 4) == [(0, 4), (4, 8), (8, 12), (12, 15)] == plan(np.full(15, -1), 4)
    assert plan(spans, 1) == [(0, 1), (1, 2), (2, 5), (5, 6), (6, 13), (13, 14), (14, 15)]  # kv mode: a span a step
    # a block that starts inside a span (a prefix kept to there) runs to the span's end
    assert block_end(spans, 8, 2, 15) == 13
