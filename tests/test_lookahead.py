"""Lookahead decoding (prompt-lookup drafts verified in one decoder call): the drafter, and the engine on the fake
decoder of test_engine_fake (greedy ids identical to plain decoding, rejected rows never in the cache).
The real bundles of both families are checked in test_lookahead_bundles.py."""

import numpy as np
import pytest
from test_engine_fake import V, make_engine, reference_greedy

from vlmrt.runtime.lookahead import MIN_GAIN, PromptLookup
from vlmrt.runtime.sampler import Sampler, SamplingConfig


def test_prompt_lookup_copies_what_followed_the_latest_ngram():
    d = PromptLookup(3, [1, 2, 3, 4, 5, 9, 2, 3])
    assert d.propose(10) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    assert d.propose(2) == [4, 5]  # no more than the room left
    d.append(7)
    assert d.propose(10) == []  # "3 7" and "2 3 7" never occurred
    d = PromptLookup(4, [5, 6, 1, 5, 6, 2, 8, 5, 6])
    assert d.propose(10) == [2, 8, 5, 6]  # the latest occurrence wins


def test_prompt_lookup_backs_off_after_misses():
    d = PromptLookup(2, [1, 2, 1, 2, 1, 2])
    waits = []
    for i in range(7):
        assert d.propose(5) == [1, 2]
        d.feedback(i % MIN_GAIN)  # fewer than MIN_GAIN accepted: a miss
        n = 0
        while d.propose(5) == []:
            n += 1
        waits.append(n)
        d.wait = 0
    assert waits == [4, 8, 16, 32, 64, 64, 64]
    for pause in (32, 16, 8, 4, 2, 1, 0):  # calls that accept MIN_GAIN drafts halve the back-off
        d.feedback(MIN_GAIN)
        assert d.pause == pause and d.propose(5) == [1, 2]


def prompts():
    rng = np.random.default_rng(7)
    out = [list(rng.integers(1, V, n)) for n in (1, 3, 5, 9)]
    for n in (2, 3, 5):  # copy-heavy: a list said twice, so that its third time can be drafted
        part = list(rng.integers(1, V, n))
        out.append(part + part + part[:1])
    return out


def test_lookahead_the_decoder_cannot_verify_is_refused():
    """Static graphs without a verify graph, and a draft block over the graph's AR are refused at construction."""
    with pytest.raises(ValueError, match="cannot verify lookahead drafts .no verify graph.*--lookahead-ar"):
        make_engine(lookahead=2)
    with pytest.raises(ValueError, match="at most 3"):
        make_engine(one_graph=True, lookahead=4)
    with pytest.raises(ValueError, match=r"at most 2 for this bundle \(its verify graph's AR is 3\)"):
        make_engine(verify_ar=3, lookahead=3)


@pytest.mark.parametrize("static", [False, True], ids=["one-graph", "static-verify"])
def test_lookahead_greedy_ids_and_cache_equal_plain(static):
    """Many prompts, k = 1..3, both modes: the same ids as plain decoding and as the full-sequence reference, the
    cache rows equal to a plain run's (to float rounding: a verify step computes them in a batch), and no row beyond
    the cache's length written (rejected drafts' rows are dropped). static: static graphs (the HTP target's) with a
    verify graph of AR 4, every verify call a padded block of 4 rows."""
    kw = dict(verify_ar=4, ar=5) if static else dict(one_graph=True)  # (prefill blocks of 5: told apart)
    drafted = accepted = 0
    for k in (1, 2, 3):
        plain, _ = make_engine(max_context=40, **kw)
        fast, fake = make_engine(max_context=40, lookahead=k, **kw)
        for prompt in prompts():
            want = reference_greedy(plain, fake, prompt, 16)
            for mode in ("kv", "hybrid"):
                a = list(plain.generate(plain.embed(prompt), mode=mode, max_new_tokens=16, ignore_eos=True))
                fast.cache.data[:] = 0  # so that a row written beyond the length shows
                fake.calls.clear()
                b = list(fast.generate(fast.embed(prompt), mode=mode, max_new_tokens=16, ignore_eos=True,
                                       prompt_ids=prompt))
                assert a == b == want, (k, mode, prompt)
                n = fast.cache.length
                assert n == plain.cache.length == len(prompt) + 15
                np.testing.assert_allclose(fast.cache.data[:, :, :n], plain.cache.data[:, :, :n], rtol=0, atol=1e-5)
                assert not fast.cache.data[:, :, n:].any(), "rows beyond the cache length were written"
                st = fast.last
                drafted, accepted = drafted + st.drafted_tokens, accepted + st.accepted_tokens
                steps = len(st.step_times)
                assert steps == 15 - st.accepted_tokens and max(fake.calls) <= max(kw.get("ar", 4), 1 + k)
                if static and st.drafted_tokens:  # padded verify blocks of the verify graph's AR
                    assert 4 in fake.calls[-steps:] and set(fake.calls[-steps:]) <= {1, 4}
    assert accepted > 0 and drafted > accepted  # drafts were taken, and some were rejected


def test_lookahead_stops_like_plain_at_eos_length_and_context():
    """EOS inside the drafts, max_new_tokens and a full cache stop a lookahead run where a plain run stops."""
    for max_context, eos_bias in ((14, 0.0), (40, 4.0)):
        plain, fp = make_engine(max_context=max_context, one_graph=True)
        fast, ff = make_engine(max_context=max_context, one_graph=True, lookahead=3)
        fp.bias[0] = ff.bias[0] = eos_bias  # EOS (id 0) turns up now and then
        for prompt in prompts():
            for n in (1, 2, 7, 30):
                a = list(plain.generate(plain.embed(prompt), mode="kv", max_new_tokens=n))
                b = list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=n, prompt_ids=prompt))
                assert a == b and plain.last.stop_reason == fast.last.stop_reason, (prompt, n)
                assert plain.cache.length == fast.cache.length


def test_lookahead_is_off_for_sampling_and_without_prompt_ids():
    fast, fake = make_engine(one_graph=True, lookahead=3)
    prompt = prompts()[-1]
    sampler = Sampler(SamplingConfig(temperature=0.8, seed=1))
    list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, sampler=sampler, prompt_ids=prompt))
    assert fast.last.drafted_tokens == 0
    fake.calls.clear()
    list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, ignore_eos=True))
    assert fast.last.drafted_tokens == 0 and set(fake.calls) == {1}
