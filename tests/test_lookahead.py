"""Lookahead decoding (prompt-lookup drafts verified in one decoder call): the drafter, and the engine on the fake
decoder of test_engine_fake (greedy ids identical to plain decoding, rejected rows never in the cache).
The real bundles of both families are checked in test_lookahead_bundles.py."""

import numpy as np
import pytest
from test_engine_fake import V, make_engine, reference_greedy

from vlmrt.runtime.decode import lookahead
from vlmrt.runtime.decode.lookahead import MIN_GAIN, PromptLookup
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig


def test_prompt_lookup_copies_what_followed_the_latest_ngram():
    d = PromptLookup(3, [1, 2, 3, 4, 5, 9, 1, 2, 3], adapt=False)
    assert d.propose(10) == [4, 5, 9]  # "1 2 3" was followed by 4 5 9
    assert d.propose(2) == [4, 5]  # no more than the room left
    d.append(7)
    assert d.propose(10) == []  # "2 3 7" never occurred
    d = PromptLookup(3, [8, 2, 3], adapt=False)
    assert d.propose(10) == []  # a 2-gram ("2 3") is not enough
    d = PromptLookup(4, [5, 6, 7, 1, 5, 6, 7, 2, 8, 5, 6, 7], adapt=False)
    assert d.propose(10) == [2, 8, 5, 6]  # the latest occurrence wins


def test_prompt_lookup_drafts_from_the_answer():
    """An answer that repeats itself is drafted from its own earlier tokens: here the prompt holds none of them."""
    d = PromptLookup(8, [90, 91, 92])
    answer = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for t in answer + [10, 11, 12]:  # the answer starts to say itself again
        d.append(t)
    assert d.propose(20) == [13, 14, 15, 16]  # START long, from the answer's first saying
    d.feedback(4, 4)
    assert d.propose(20) == [13, 14, 15, 16, 17, 18, 19, 10]  # all accepted: twice as long


def test_prompt_lookup_adapts_the_draft_length():
    ids = list(range(40)) * 2
    d = PromptLookup(16, ids[:43])  # "... 0 1 2" again: the second saying drafts from the first
    lengths = []
    for accepted in ("all", "all", "all", "all", 5, 1, "all"):
        drafts = d.propose(100)
        lengths.append(len(drafts))
        assert drafts == ids[43 : 43 + len(drafts)]
        d.feedback(len(drafts) if accepted == "all" else accepted, len(drafts))
        if accepted != "all":
            d.wait = 0
    # 4, doubled after each call that took all (up to k = 16); after 5 of 16: 8; after 1 (a miss): START
    assert lengths == [4, 8, 16, 16, 16, 8, 4]
    assert PromptLookup(16, [1, 2, 3, 4, 1, 2, 3]).propose(3) == [4, 1]  # cut to a power of two (one verify shape)
    assert PromptLookup(16, [1, 2, 3, 4, 1, 2, 3]).propose(100) == [4, 1, 2, 3]  # past the end: the copy repeats
    assert PromptLookup(16, [1, 2, 3, 4, 1, 2, 3]).propose(1) == []  # one draft: not worth a verify call
    assert PromptLookup(3, [1, 2, 3, 4, 5, 9, 1, 2, 3], adapt=False).propose(10) == [4, 5, 9]  # static: k, uncut


def test_prompt_lookup_backs_off_after_misses():
    d = PromptLookup(2, [1, 2, 1, 2, 1, 2, 1])
    waits = []
    for i in range(7):
        assert d.propose(5) == [2, 1]
        d.feedback(i % MIN_GAIN, 2)  # fewer than MIN_GAIN accepted: a miss
        n = 0
        while d.propose(5) == []:
            n += 1
        waits.append(n)
        d.wait = 0
    assert waits == [8, 16, 32, 64, 64, 64, 64]
    for pause in (32, 16, 8, 4, 2, 1, 0):  # calls that accept MIN_GAIN drafts halve the back-off
        d.feedback(MIN_GAIN, 2)
        assert d.pause == pause and d.propose(5) == [2, 1]


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
def test_lookahead_greedy_ids_and_cache_equal_plain(static, monkeypatch):
    """Many prompts, k = 1..3, both modes: the same ids as plain decoding and as the full-sequence reference, the
    cache rows equal to a plain run's (to float rounding: a verify step computes them in a batch), and no row beyond
    the cache's length written (rejected drafts' rows are dropped). static: static graphs (the HTP target's) with a
    verify graph of AR 4, every verify call a padded block of 4 rows."""
    # 2-grams and short pauses: more drafts (the fake model's answers copy by chance only), some accepted
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 4)
    kw = dict(verify_ar=4, ar=5) if static else dict(one_graph=True)  # (prefill blocks of 5: told apart)
    drafted = accepted = 0
    for k in (1, 2, 3):
        plain, _ = make_engine(max_context=40, **kw)
        fast, fake = make_engine(max_context=40, lookahead=k, **kw)
        for prompt in prompts():
            want = reference_greedy(plain, fake, prompt, 16)
            for mode in ("kv", "hybrid"):
                a = list(plain.generate(plain.embed(prompt), mode=mode, max_new_tokens=16, ignore_eos=True))
                fast.rows[0].cache.data[:] = 0  # so that a row written beyond the length shows
                fake.calls.clear()
                b = list(fast.generate(fast.embed(prompt), mode=mode, max_new_tokens=16, ignore_eos=True,
                                       prompt_ids=prompt))
                assert a == b == want, (k, mode, prompt)
                n = fast.rows[0].cache.length
                assert n == plain.rows[0].cache.length == len(prompt) + 15
                np.testing.assert_allclose(fast.rows[0].cache.data[:, :, :n], plain.rows[0].cache.data[:, :, :n], rtol=0, atol=1e-5)
                assert not fast.rows[0].cache.data[:, :, n:].any(), "rows beyond the cache length were written"
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
                assert plain.rows[0].cache.length == fast.rows[0].cache.length


def test_lookahead_is_off_for_sampling_and_without_prompt_ids():
    fast, fake = make_engine(one_graph=True, lookahead=3)
    prompt = prompts()[-1]
    sampler = Sampler(SamplingConfig(temperature=0.8, seed=1))
    list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, sampler=sampler, prompt_ids=prompt))
    assert fast.last.drafted_tokens == 0
    fake.calls.clear()
    list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, ignore_eos=True))
    assert fast.last.drafted_tokens == 0 and set(fake.calls) == {1}


class CyclingSession:
    """The fake decoder's session, its logits replaced: each row's greedy next token is the one after the row's own
    token in CYCLE (a prompt token leads to CYCLE[0]), so that the answer says CYCLE over and over."""

    CYCLE = [3, 5, 7, 9, 11, 13, 15]

    def __init__(self, fake):
        self.fake, self.table = fake, None

    def run(self, names, feeds):
        out = dict(zip(names, self.fake.run(names, feeds)))
        x = feeds["inputs_embeds"]
        tokens = np.abs(x[:, None, :] - self.table[None]).sum(-1).argmin(-1)  # each row's token id
        nxt = [self.CYCLE[(self.CYCLE.index(t) + 1) % len(self.CYCLE)] if t in self.CYCLE else self.CYCLE[0]
               for t in tokens]
        logits = np.zeros((len(tokens), V), np.float32)
        logits[np.arange(len(tokens)), nxt] = 10
        out["logits"] = logits[feeds["logit_rows"]] if "logit_rows" in feeds else logits
        return [out[n] for n in names]


def test_lookahead_drafts_from_the_answer():
    """The prompt holds none of the answer's tokens, the answer repeats itself: every draft comes from the answer
    (the engine appends each emitted token to the drafter), most of them accepted, with plain decoding's ids."""
    runs = {}
    for k in (0, 8):
        holder = {}
        engine, fake = make_engine(max_context=80, ar=10, one_graph=True, lookahead=k,
                                   wrap=lambda f: holder.setdefault("s", CyclingSession(f)))
        holder["s"].table = engine.embed(list(range(V)))
        prompt = [20, 21, 22]
        runs[k] = (list(engine.generate(engine.embed(prompt), mode="kv", max_new_tokens=60, ignore_eos=True,
                                        prompt_ids=prompt)), engine.last, fake.calls)
    (plain, _, _), (fast, st, calls) = runs[0], runs[8]
    assert plain == fast == [CyclingSession.CYCLE[i % 7] for i in range(60)]
    assert st.accepted_tokens >= 40 and st.drafted_tokens - st.accepted_tokens <= 8, st
    assert max(calls) == 9  # the draft length grew to k
