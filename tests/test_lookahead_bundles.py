"""Lookahead decoding on exported fixture bundles of both families (SmolVLM and InternVL, the session's exports):
greedy ids identical to plain decoding on many prompts, copy-heavy ones among them, in kv and hybrid mode, and the
KV cache after a lookahead run equal to a plain run's (no rejected draft's row in it)."""

import numpy as np
import pytest

from conftest import image_file
from vlmrt.runtime.decode import lookahead
from vlmrt.runtime.vlm import VLM

PROMPTS = [
    ("Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana.", None),
    ("Reformat as lines: red green blue, red green blue, red green blue, red green blue", None),
    ("Copy: 1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10", None),
    ("Write a short story about a lighthouse.", None),
    ("What is in the image? Describe the colours.", "chelsea.png"),
    ("Transcribe the text in the image, then repeat it twice.", "page.png"),
]


def check_family(bundle, monkeypatch, tokens=24):
    # 2-grams and short pauses: more drafts (a random fixture model copies by chance only), some accepted
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 4)
    plain, fast = VLM.load(bundle), VLM.load(bundle, lookahead=4)
    drafted = accepted = 0
    for prompt, image in PROMPTS:
        img = image_file(image, None) if image else None
        for mode in ("kv", "hybrid"):
            for vlm in (plain, fast):
                vlm.row.cache.data[:] = 0  # so that a row written beyond the cache length shows
            a = plain(prompt, img, mode=mode, max_new_tokens=tokens, ignore_eos=True)
            b = fast(prompt, img, mode=mode, max_new_tokens=tokens, ignore_eos=True)
            assert a.token_ids == b.token_ids, (prompt, mode)
            pc, fc = plain.row.cache, fast.row.cache
            assert pc.length == fc.length
            # rows of a verify step come from a batched call: equal to float rounding (measured max 1e-5 here)
            np.testing.assert_allclose(fc.stored(), pc.stored(), rtol=0, atol=1e-4)
            if fast.row.kind.name != "gqa_in_place":  # (its graph writes every row it computes; beyond the
                # length they are stale)
                assert not fc.data[:, :, fc.length:].any(), "a rejected draft's row is in the cache"
            drafted += b.stats.drafted_tokens
            accepted += b.stats.accepted_tokens
            assert a.stats.drafted_tokens == 0
    assert accepted > 0 and drafted >= accepted
    return drafted, accepted


def test_smolvlm_lookahead_equals_plain(default_bundle, monkeypatch):
    check_family(default_bundle.bundle, monkeypatch)


@pytest.mark.parametrize("case", [0])
def test_internvl_lookahead_equals_plain(tmp_path_factory, case, monkeypatch):
    pytest.importorskip("torch")
    import test_internvl

    check_family(test_internvl.exported(test_internvl.CASES[case], tmp_path_factory).bundle, monkeypatch)
