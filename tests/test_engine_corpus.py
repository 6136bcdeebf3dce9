"""The engine corpus (tests/engine_corpus.py, tests/data/engine_corpus.json): every case run again on the suite's
session exports and held against the answers recorded on main 6bf0bd2, before issue 44's engine refactor. On a machine
whose kernel signature has a record: greedy ids and the sha256 of the teacher-forced logits (and of the batched rows'
logits) bit for bit. Elsewhere: each greedy sequence's ids up to the first step whose recorded top-2 margin is within
the precision's cross-signature tolerance, measured between the two recorded signatures (the record's "tolerance":
2x the largest |logit difference| on the same ids; docs/testing.md#the-engine-corpus), never set by hand.

It guards the refactor: a change in the engine, the step, a decoder kind, the cache or the batch that moves one bit of
one logit fails it (shown: one logit's last bit flipped, a position off by one)."""

from __future__ import annotations

import copy

import pytest

import engine_corpus as ec

pytest.importorskip("torch")

CORPUS = ec.read()
SIGNATURE = ec.signature()


@pytest.mark.parametrize("case", ec.CASES, ids=[c.id for c in ec.CASES])
def test_case_answers_as_recorded(case, tmp_path_factory):
    got, _ = ec.run_case(case, tmp_path_factory)
    ec.compare(case, got, CORPUS, SIGNATURE)


def test_every_case_is_recorded_on_every_signature():
    """The record covers the case list on each signature (a case added without recording, or dropped from the list
    with its record kept, fails), and names a tolerance for each precision."""
    ids = sorted(c.id for c in ec.CASES)
    assert CORPUS["signatures"]
    for sig, entry in CORPUS["signatures"].items():
        assert sorted(entry["cases"]) == ids, sig
    assert {c.precision for c in ec.CASES} <= set(CORPUS["tolerance"])


def test_the_comparison_fails_on_one_bit_of_one_logit():
    """compare() itself: a record whose logits hash or one id differs fails, on a recorded signature and off it."""
    sig, entry = next(iter(CORPUS["signatures"].items()))
    case = next(c for c in ec.CASES if c.run == "answer")
    want = entry["cases"][case.id]
    assert ec.compare(case, copy.deepcopy(want), CORPUS, sig) == "exact"
    other = copy.deepcopy(want)
    other["logits"] = other["logits"][:-1] + ("0" if other["logits"][-1] != "0" else "1")
    with pytest.raises(AssertionError, match="logits differ"):
        ec.compare(case, other, CORPUS, sig)
    other = copy.deepcopy(want)
    k = next(i for i, m in enumerate(want["margins"]) if m > CORPUS["tolerance"][case.precision]["margin"])
    other["ids"][k] += 1
    with pytest.raises(AssertionError, match="ids differ"):
        ec.compare(case, other, CORPUS, sig)
    with pytest.raises(AssertionError, match="ids differ"):
        ec.compare(case, other, CORPUS, "a machine without a record")
    assert ec.compare(case, copy.deepcopy(want), CORPUS, "a machine without a record") == "within"


def test_the_recorded_signatures_agree_within_the_tolerance():
    """Each signature's record held against the others' as a machine without a record is (compare's "within" rule):
    a case re-recorded on one signature with other answers, and not on the others, fails here."""
    for sig, entry in CORPUS["signatures"].items():
        others = {**CORPUS, "signatures": {s: e for s, e in CORPUS["signatures"].items() if s != sig}}
        for case in ec.CASES:
            assert ec.compare(case, entry["cases"][case.id], others, sig) == "within"
