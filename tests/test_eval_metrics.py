"""`vlmrt eval`'s metrics on hand-computed examples: first-token match, top-1 agreement and the
direction of the KL divergence (reference ‖ bundle), independent of any model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vlmrt.eval.metrics import compare_logits


def kl(p, q) -> float:
    return math.fsum(a * math.log(a / b) for a, b in zip(p, q))


# next-token distributions over a 3-token vocabulary, three positions
REF = [(1 / 3, 2 / 3, 0.0 + 1e-300), (0.5, 0.25, 0.25), (0.1, 0.2, 0.7)]
GOT = [(0.75, 0.25 - 1e-12, 1e-12), (0.5, 0.25, 0.25), (0.2, 0.2, 0.6)]


def logits(rows, shift=0.0):
    return np.log(np.array(rows, dtype=np.float64)) + shift  # softmax(log p + c) = p


def test_compare_logits_hand_computed():
    # positions 0: ref says token 1, bundle token 0 (disagree); 1: same distribution (KL 0); 2: both token 2
    r = compare_logits(logits(REF, 5.0).astype(np.float32), logits(GOT, -3.0).astype(np.float32))
    assert r["positions"] == 3 and r["first_token_match"] is False and r["agree_count"] == 2
    assert r["top1"] == pytest.approx(2 / 3, abs=0)
    # position 0 by hand: 1/3 ln((1/3)/(3/4)) + 2/3 ln((2/3)/(1/4)) (the ~0 third token adds ~0)
    k0 = 1 / 3 * math.log(4 / 9) + 2 / 3 * math.log(8 / 3)
    k2 = 0.1 * math.log(0.5) + 0.2 * math.log(1.0) + 0.7 * math.log(7 / 6)
    assert k0 == pytest.approx(kl(REF[0], GOT[0]), rel=1e-9) and k2 == pytest.approx(kl(REF[2], GOT[2]), rel=1e-12)
    assert r["kl_sum"] == pytest.approx(k0 + k2, rel=1e-5)
    assert r["kl"] == pytest.approx((k0 + k2) / 3, rel=1e-5)


def test_kl_is_reference_given_bundle_not_the_reverse():
    ref, got = [(0.1, 0.2, 0.7)], [(0.2, 0.2, 0.6)]
    forward, reverse = kl(ref[0], got[0]), kl(got[0], ref[0])
    assert abs(forward - reverse) > 0.005  # the example tells the two directions apart
    r = compare_logits(logits(ref), logits(got))
    assert r["kl"] == pytest.approx(forward, rel=1e-9) and r["first_token_match"] is True and r["top1"] == 1.0


def test_compare_logits_scores_the_common_prefix():
    """A bundle that produced fewer positions than the reference is scored on those it has."""
    r = compare_logits(logits(REF), logits(GOT[:1]))
    assert r["positions"] == 1 and r["agree_count"] == 0 and r["top1"] == 0.0
    assert r["kl"] == pytest.approx(kl(REF[0], GOT[0]), rel=1e-6)
