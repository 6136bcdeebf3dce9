"""The engine, KV cache and sampler against a fake decoder session: no ONNX file, no weights.

The fake session is a one-layer attention model in numpy that honours the graph contract of
families/layers.py (reads the cache + mask, returns only new rows), so kv mode, hybrid mode
and a no-cache full-sequence computation must agree.
"""

import numpy as np
import pytest

from vlmrt.format.manifest import DecoderSpec, KVSpec, PositionsSpec, RowsDynamicKind, RowsStaticKind, attention_layers
from vlmrt.runtime.decode.cache_row import ContextOverflow, DecoderConfig, DecoderSessions
from vlmrt.runtime.decode.scheduler import Scheduler
from vlmrt.runtime.decode.kv_cache import attention_mask
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig

H, V, D = 8, 23, 8


class FakeDecoder:
    def __init__(self, rng):
        self.wq, self.wk, self.wv = (rng.standard_normal((H, D)) for _ in range(3))
        self.wo = rng.standard_normal((D, V)) * 3
        self.pe = rng.standard_normal((64, H))  # a position term, so that outputs depend on positions
        self.bias = np.zeros(V)
        self.calls = []

    def logits_full(self, x, positions=None):
        """Reference: causal attention over the whole sequence at once (at positions, default 0..n-1)."""
        x = x + self.pe[np.arange(len(x)) if positions is None else positions]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        s = q @ k.T + np.triu(np.full((len(x), len(x)), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v @ self.wo

    def run(self, names, feeds):
        x = feeds["inputs_embeds"].astype(np.float64) + self.pe[feeds["position_ids"][0]]  # [1, ar]: one rope row
        self.calls.append(x.shape[0])
        k_new, v_new = x @ self.wk, x @ self.wv
        k = np.concatenate([feeds["past_key_0"], k_new])
        v = np.concatenate([feeds["past_value_0"], v_new])
        s = (x @ self.wq) @ k.T + feeds["attention_mask"]
        p = np.exp(s - s.max(-1, keepdims=True))
        logits = (p / p.sum(-1, keepdims=True)) @ v @ self.wo + self.bias
        if "logit_rows" in feeds:  # a one-graph export (kind rows_dynamic): those rows' logits
            logits = logits[feeds["logit_rows"]]
        out = {"logits": logits, "new_key_0": k_new, "new_value_0": v_new}
        return [out[n].astype(np.float32) for n in names]


def make_engine(max_context=24, ar=4, seed=0, one_graph=False, context_step=0, wrap=lambda fake: fake,
                lookahead=0, verify_ar=0):
    """one_graph: a graph symbolic in AR with a logit_rows input (kind rows_dynamic), else kind rows_static;
    verify_ar: static graphs with a lookahead verify graph of that AR (the same fake serves it)."""
    rng = np.random.default_rng(seed)
    fake = FakeDecoder(rng)
    kv = KVSpec(max_context=max_context, dtype="float32", layers=attention_layers(1, 1, D))
    kind = (RowsDynamicKind("rows_dynamic", "attention_mask", context_step or 4, "logit_rows") if one_graph else
            RowsStaticKind("rows_static", "attention_mask", context_step, verify_ar=verify_ar))
    dec = DecoderSpec(hidden_size=H, vocab_size=V, prefill_ar=ar, embeds_input="inputs_embeds",
                      positions=PositionsSpec("position_ids"), logits_output="logits", embedding_file="embed.npy",
                      embedding_dtype="float32", kind=kind)
    table = rng.standard_normal((V, H)).astype(np.float32)
    session = wrap(fake)
    sessions = DecoderSessions(decode=session, prefill=session, verify=session if verify_ar else None)
    return Scheduler(sessions, DecoderConfig(kv, dec, eos_ids=[0], lookahead=lookahead), table), fake


def reference_greedy(engine, fake, prompt_ids, n):
    ids = list(prompt_ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(fake.logits_full(engine.embed(ids).astype(np.float64))[-1]))
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("n_prompt", [1, 3, 4, 5, 9])
def test_kv_and_hybrid_match_full_sequence(n_prompt):
    engine, fake = make_engine()
    prompt = list(np.random.default_rng(n_prompt).integers(1, V, n_prompt))
    want = reference_greedy(engine, fake, prompt, 10)
    assert len(set(want)) >= 2  # the fake model is not degenerate
    for mode in ("kv", "hybrid"):
        fake.calls.clear()
        got = list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=10, ignore_eos=True))
        assert got == want, mode
        if mode == "hybrid":  # prompt in ceil(n/ar) padded blocks, then AR=1 steps
            blocks = -(-n_prompt // 4)
            assert fake.calls[:blocks] == [4] * blocks and set(fake.calls[blocks:]) <= {1}


@pytest.mark.parametrize("n_prompt", [1, 4, 9])
def test_one_graph_feeds_exact_rows_and_reads_last_logits(n_prompt):
    """A graph symbolic in AR (kind rows_dynamic, one session for prefill and decode): the last prefill block
    is fed its real rows only, never padding, and the engine reads the single logits row it asks for with
    logit_rows."""
    engine, fake = make_engine(one_graph=True)
    prompt = list(np.random.default_rng(n_prompt).integers(1, V, n_prompt))
    want = reference_greedy(engine, fake, prompt, 10)
    for mode in ("kv", "hybrid"):
        fake.calls.clear()
        assert list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=10, ignore_eos=True)) == want, mode
        if mode == "hybrid":
            blocks = [4] * (n_prompt // 4) + ([n_prompt % 4] if n_prompt % 4 else [])
            assert fake.calls[: len(blocks)] == blocks and set(fake.calls[len(blocks):]) == {1}
    rows = engine.rows[0].score(engine.embed(prompt), want[:3])
    assert rows.shape == (3, V) and list(rows.argmax(-1)) == want[:3]


def test_stops_at_eos_length_and_context():
    engine, fake = make_engine(max_context=12)
    prompt = engine.embed([5, 6, 7])
    toks = list(engine.generate(prompt, mode="kv", max_new_tokens=4, ignore_eos=True))
    assert len(toks) == 4 and engine.last.stop_reason == "length"
    toks = list(engine.generate(prompt, mode="hybrid", max_new_tokens=100, ignore_eos=True))
    # 3 prompt slots + one slot per generated token but the last: the cache holds 12
    assert len(toks) == 12 - 3 + 1 and engine.last.stop_reason == "context"
    assert engine.last.prompt_tokens == 3 and engine.last.generated_tokens == len(toks)
    with pytest.raises(ContextOverflow, match="max-seq-len"):
        list(engine.generate(engine.embed(list(range(1, 13))), mode="kv"))


def test_eos_is_not_yielded():
    engine, fake = make_engine()
    fake.bias[0] = 1e3  # make EOS (id 0) win
    assert list(engine.generate(engine.embed([3, 4]), max_new_tokens=5)) == []
    assert engine.last.stop_reason == "eos"


def test_attention_mask_layout():
    m = attention_mask(pos=3, ar=2, max_context=5)
    neg = np.finfo(np.float32).min
    assert m.shape == (2, 7)
    assert (m[:, :3] == 0).all() and (m[:, 3:5] == neg).all()  # cache slots 0..2 visible, 3..4 not
    assert m[0, 5] == 0 and m[0, 6] == neg and (m[1, 5:] == 0).all()  # causal within the step


def test_sampler_greedy_topk_topp_seed():
    logits = np.array([0.0, 5.0, 4.9, -2.0, 1.0])
    assert Sampler(SamplingConfig())(logits) == 1
    draws = [Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=s))(logits) for s in range(50)]
    assert set(draws) == {1, 2}
    assert {Sampler(SamplingConfig(temperature=1.0, top_p=0.3, seed=s))(logits) for s in range(20)} == {1}
    a = [Sampler(SamplingConfig(temperature=1.0, seed=7))(logits) for _ in range(5)]
    s = Sampler(SamplingConfig(temperature=1.0, seed=7))
    assert a[0] == Sampler(SamplingConfig(temperature=1.0, seed=7))(logits)
    seq1 = [s(logits) for _ in range(20)]
    s2 = Sampler(SamplingConfig(temperature=1.0, seed=7))
    assert seq1 == [s2(logits) for _ in range(20)]
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0).validate()


class ShapeRecorder:
    def __init__(self, inner):
        self.inner, self.ctxs = inner, []

    def run(self, names, feeds):
        ctx = feeds["past_key_0"].shape[0]
        assert feeds["attention_mask"].shape[1] == ctx + feeds["inputs_embeds"].shape[0]
        self.ctxs.append((int(feeds["position_ids"][0, 0]), ctx))
        return self.inner.run(names, feeds)


@pytest.mark.parametrize("kw, needle", [
    (dict(temperature="1"), "temperature must be a number, not str"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer, not float"),  # was numpy's "Partition index must be integer"
    (dict(temperature=1.0, seed="7"), "seed must be an integer or None, not str"),
    (dict(top_p=None), "top_p must be a number, not NoneType"),
])
def test_sampling_options_of_the_wrong_type_are_named(kw, needle):
    with pytest.raises(TypeError, match=needle):
        Sampler(SamplingConfig(**kw))
    Sampler(SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int32(1)))  # numpy scalars are fine


def test_symbolic_context_reads_the_prefix_it_needs():
    """Graphs with a symbolic cache length (DecoderSpec.context_step): each step reads the cache prefix that holds
    its past, rounded up to the step, and the tokens are those of the full-cache graphs."""
    engine, fake = make_engine(max_context=24, ar=4)
    prompt = list(np.random.default_rng(3).integers(1, V, 7))
    want = list(engine.generate(engine.embed(prompt), mode="hybrid", max_new_tokens=15, ignore_eos=True))
    for mode in ("hybrid", "kv"):
        recorders = []
        engine, _ = make_engine(max_context=24, ar=4, context_step=8, wrap=lambda f: recorders.append(ShapeRecorder(f)) or recorders[0])
        rec = recorders[0]
        got = list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=15, ignore_eos=True))
        assert got == want, mode
        assert all(ctx == min(24, max(8, -(-pos // 8) * 8)) for pos, ctx in rec.ctxs)
        assert {ctx for _, ctx in rec.ctxs} == {8, 16, 24}  # 7 prompt + 15 tokens: positions 0..20
    assert rec.ctxs[:3] == [(0, 8), (1, 8), (2, 8)] and (9, 16) in rec.ctxs and (17, 24) in rec.ctxs


@pytest.mark.parametrize("one_graph", [False, True])
@pytest.mark.parametrize("positions", [[5, 6, 7, 8, 9, 10], [0, 1, 2, 2, 2, 3], [0, 3, 3, 3, 4, 9]])
def test_positions_apart_from_slots(one_graph, positions):
    """The rope positions are an input of their own (decoder.positions): a prompt fed at positions that are not its
    slots (an M-RoPE image's rows share positions; a rope delta shifts them) gives the answer of the model run at those
    positions, each generated token one past the largest position before it, while the rows still go to slots
    0, 1, 2, ... (the cache keeps each slot's position); kv and hybrid mode agree, and a prefix reuse resumes them."""
    engine, fake = make_engine(one_graph=one_graph)
    prompt = [3, 9, 4, 11, 2, 7]
    pos = np.array([positions])
    ids, want, p = list(prompt), [], list(positions)
    for _ in range(6):
        t = int(np.argmax(fake.logits_full(engine.embed(ids).astype(np.float64), np.array(p))[-1]))
        want.append(t)
        ids.append(t)
        p.append(max(p) + 1)
    for mode in ("kv", "hybrid"):
        got = list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=6, ignore_eos=True, positions=pos))
        assert got == want, mode
        assert engine.rows[0].cache.length == len(prompt) + 5 and list(engine.rows[0].cache.positions[0, : engine.rows[0].cache.length]) == p[:-1]
    # the default (positions None) is slots: a different answer here, the one of plain positions
    plain = list(engine.generate(engine.embed(prompt), mode="kv", max_new_tokens=6, ignore_eos=True))
    assert plain == reference_greedy(engine, fake, prompt, 6)
    # resume after the first 4 rows (kv mode: every row reusable): positions of the rest, from slot 4
    list(engine.generate(engine.embed(prompt), mode="kv", max_new_tokens=1, ignore_eos=True, positions=pos))
    start = engine.rows[0].reusable("kv", 4)
    assert start == 4 and engine.rows[0].cache.position_after(4) == max(positions[:4]) + 1
    got = list(engine.generate(engine.embed(prompt)[4:], mode="kv", max_new_tokens=6, ignore_eos=True, start=4,
                               positions=pos[:, 4:]))
    assert got == want
    with pytest.raises(ValueError, match=r"positions must be \[1, 6\]"):
        engine.rows[0].prefill(engine.embed(prompt), "kv", positions=np.zeros((2, 6), np.int64))
