"""The cache is built from the manifest's list of per-layer kinds (kv.layers), so a decoder with mixed layers
(attention layers of different widths, short-convolution layers as LFM2's) runs through the unchanged engine.

The fake session is a numpy model of such a decoder that honours the rows contract per layer kind (attention: reads
the cache + mask, returns its new K/V rows; conv: reads the `width` rows before the step, returns its own rows), so
kv mode, hybrid mode, a prefix reuse and lookahead must agree with a no-cache full-sequence computation."""

import numpy as np
import pytest

from vlmrt.format.manifest import (
    AttentionLayer,
    ConvLayer,
    DecoderSpec,
    KVSpec,
    PositionsSpec,
    RowsDynamicKind,
    RowsStaticKind,
    SharedKVLayer,
    SlidingAttentionLayer,
)
from vlmrt.runtime.decode import lookahead
from vlmrt.runtime.decode.cache_row import DecoderConfig, DecoderSessions
from vlmrt.runtime.decode.scheduler import Scheduler
from vlmrt.runtime.decode.kv_cache import HEADS, KVCache

H, V = 8, 19
LAYERS = [AttentionLayer("attention", 2, 4, "k0", "v0", "nk0", "nv0"),  # kv_dim 8
          ConvLayer("conv", 6, 2, "c1", "nc1"),
          AttentionLayer("attention", 3, 4, "k2", "v2", "nk2", "nv2"),  # kv_dim 12: a block of its own
          ConvLayer("conv", 6, 3, "c3", "nc3"),
          AttentionLayer("attention", 1, 8, "k4", "v4", "nk4", "nv4")]  # kv_dim 8 again: layer 0's block


class MixedDecoder:
    """Each layer reads the embeddings x (+ a position term) and adds its output to the logits' input."""

    def __init__(self, rng):
        self.pe = rng.standard_normal((64, H))
        self.w = {}
        for i, layer in enumerate(LAYERS):
            if layer.kind == "attention":
                d = layer.dim
                self.w[i] = [rng.standard_normal((H, d)) for _ in range(3)] + [rng.standard_normal((d, H))]
            else:
                self.w[i] = [rng.standard_normal((H, layer.channels)), rng.standard_normal((layer.width + 1, 1)),
                             rng.standard_normal((layer.channels, H))]
        self.head = rng.standard_normal((H, V)) * 2
        self.calls = []

    def _attend(self, w, x, k, v, mask):
        s = (x @ w[0]) @ k.T + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v @ w[3]

    def full(self, x, positions):
        """Logits of every row of the whole sequence at once, no cache."""
        x = x + self.pe[positions]
        n, h = len(x), x.copy()
        causal = np.triu(np.full((n, n), -np.inf), 1)
        for i, layer in enumerate(LAYERS):
            w = self.w[i]
            if layer.kind == "attention":
                h += self._attend(w, x, x @ w[1], x @ w[2], causal)
            else:
                rows = np.concatenate([np.zeros((layer.width, layer.channels)), x @ w[0]])
                conv = sum(rows[j : j + n] * w[1][j] for j in range(layer.width + 1))  # causal, kernel width + 1
                h += np.tanh(conv) @ w[2]
        return h @ self.head

    def run(self, names, feeds):
        x = feeds["inputs_embeds"].astype(np.float64) + self.pe[feeds["position_ids"][0]]
        self.calls.append(x.shape[0])
        out, h = {}, x.copy()
        for i, layer in enumerate(LAYERS):
            w = self.w[i]
            if layer.kind == "attention":
                kn, vn = x @ w[1], x @ w[2]
                k = np.concatenate([feeds[layer.key_input], kn])
                v = np.concatenate([feeds[layer.value_input], vn])
                h += self._attend(w, x, k, v, feeds["attention_mask"])
                out[layer.key_output], out[layer.value_output] = kn, vn
            else:
                window = feeds[layer.state_input]
                assert window.shape == (layer.width, layer.channels)
                new = x @ w[0]
                rows = np.concatenate([window, new])
                conv = sum(rows[j : j + len(x)] * w[1][j] for j in range(layer.width + 1))
                h += np.tanh(conv) @ w[2]
                out[layer.state_output] = new
        logits = h @ self.head
        if "logit_rows" in feeds:
            logits = logits[feeds["logit_rows"]]
        out["logits"] = logits
        return [out[n].astype(np.float32) for n in names]


def engine(fake_class, seed: int, layers, one_graph: bool, lookahead: int, ctx: int):
    """A Scheduler over a numpy fake decoder (fake_class(rng)) with the given cache layers: one graph with a dynamic
    row count, or static prefill / decode (and verify with lookahead) graphs; returns (scheduler, fake)."""
    rng = np.random.default_rng(seed)
    fake = fake_class(rng)
    kind = (RowsDynamicKind("rows_dynamic", "attention_mask", 8, "logit_rows") if one_graph else
            RowsStaticKind("rows_static", "attention_mask", verify_ar=4 if lookahead else 0))
    dec = DecoderSpec(hidden_size=H, vocab_size=V, prefill_ar=4, embeds_input="inputs_embeds",
                      positions=PositionsSpec("position_ids"), logits_output="logits", embedding_file="embed.npy",
                      embedding_dtype="float32", kind=kind)
    kv = KVSpec(max_context=ctx, dtype="float32", layers=layers)
    sessions = DecoderSessions(decode=fake, prefill=fake, verify=fake if lookahead and not one_graph else None)
    table = rng.standard_normal((V, H)).astype(np.float32)
    return Scheduler(sessions, DecoderConfig(kv, dec, [0], lookahead=lookahead), table), fake


def make(one_graph: bool, lookahead: int = 0, ctx: int = 32):
    return engine(MixedDecoder, 3, LAYERS, one_graph, lookahead, ctx)


def greedy(engine, fake, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(fake.full(engine.embed(ids).astype(np.float64), np.arange(len(ids)))[-1])))
    return ids[len(prompt):]


def test_cache_of_mixed_layers_allocates_per_kind():
    c = KVCache(KVSpec(max_context=16, dtype="float32", layers=LAYERS))
    assert [b.layers for b in c.blocks] == [[0, 2], [1]]  # attention layers 0 and 2 (kv_dim 8: kv.layers 0, 4) share
    assert [b.data.shape for b in c.blocks] == [(2, 2, 16, 8), (1, 2, 16, 12)]
    assert [(x.data.shape, x.window.shape) for x in c.states["conv"].rows] == [((18, 6), (2, 6)), ((19, 6), (3, 6))]
    assert [n for n, _, _ in c.inputs()] == ["k0", "v0", "c1", "k2", "v2", "c3", "k4", "v4"]
    assert c.output_names() == ["nk0", "nv0", "nc1", "nk2", "nv2", "nc3", "nk4", "nv4"]
    assert c.nbytes == 4 * (2 * 2 * 16 * 8 + 2 * 16 * 12 + 18 * 6 + 19 * 6)  # (the windows: a step's input copy)
    with pytest.raises(ValueError, match="several shapes"):
        c.data
    heads = KVCache(KVSpec(max_context=16, dtype="float32", layers=[LAYERS[0], LAYERS[2], LAYERS[4]]), HEADS)
    assert [b.data.shape for b in heads.blocks] == [(1, 2, 1, 2, 16, 4), (1, 2, 1, 3, 16, 4), (1, 2, 1, 1, 16, 8)]


@pytest.mark.parametrize("one_graph", [False, True])
def test_mixed_layers_through_the_engine_equal_the_full_sequence(one_graph, monkeypatch):
    """kv mode, hybrid mode (padded / exact last blocks), a prefix reuse and lookahead drafts over a decoder whose
    layers are attention of two widths and short convolutions: the ids of the no-cache computation, with no engine
    code of its own."""
    engine, fake = make(one_graph)
    for prompt in ([3, 9, 4], [5, 1, 7, 7, 2, 8, 11], [4, 6, 8, 10, 12, 14, 16, 18, 2]):
        want = greedy(engine, fake, prompt, 8)
        assert len(set(want)) > 1
        for mode in ("kv", "hybrid"):
            assert list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=8, ignore_eos=True)) == want
        # a prefix reuse: keep the first 4 rows (a full hybrid block) of the last run, feed the rest
        start = engine.rows[0].reusable("hybrid", 4)
        assert start == (4 if len(prompt) > 4 else 0)
        got = list(engine.generate(engine.embed(prompt)[start:], mode="hybrid", max_new_tokens=8, ignore_eos=True,
                                   start=start))
        assert got == want
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))  # 2-grams: drafts from the fake model's chance copies too
    fast, fake = make(one_graph, lookahead=3)
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]  # copy-heavy: drafts are proposed, some rejected
    want = greedy(fast, fake, prompt, 12)
    got = list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, ignore_eos=True, prompt_ids=prompt))
    assert got == want and fast.last.drafted_tokens > 0


def test_uint8_conv_rows_clear_and_requantize():
    """A uint8 cache's conv rows (HTP bundles): the rows before slot 0, a first step's window, hold the reading graph's
    zero point (clear_unused), and requantize re-expresses the written rows from prefill's encoding into decode's."""
    spec = KVSpec(max_context=8, dtype="uint8", layers=[LAYERS[1], LAYERS[0]])
    c = KVCache(spec)
    enc = {"key": [[0.1, 128]], "value": [[0.1, 120]], "conv": [[0.5, 100]]}
    c.clear_unused(enc)
    c.load_windows(0)
    assert (c.states["conv"].rows[0].window == 100).all()
    rows = [np.zeros((1, 2, 3, 8), np.uint8), np.full((3, 6), 110, np.uint8)]
    c.store(rows, 3, np.arange(3)[None])
    dst = {"key": [[0.1, 128]], "value": [[0.1, 120]], "conv": [[0.25, 90]]}
    c.requantize(enc, dst)
    assert (c.states["conv"].rows[0].data[2:5] == 90 + 20).all() and (c.states["conv"].rows[0].data[:2] == 90).all()  # (110-100)*0.5/0.25 + 90


# Gemma 4's state kinds in the rows layout (runtime/decode/windowed_state.py): a sliding-window layer keeps its rows
# by slot like an attention layer (the window is the graph's: here the fake's), a shared layer keeps none and reads
# its source's rows and the source's new rows of the step
W = 3
WINDOWED = [AttentionLayer("attention", 2, 4, "k0", "v0", "nk0", "nv0"),
            SlidingAttentionLayer("sliding_attention", 2, 4, "k1", "v1", "nk1", "nv1", window=W),
            SharedKVLayer("shared_kv", source=1),
            SlidingAttentionLayer("sliding_attention", 1, 8, "k3", "v3", "nk3", "nv3", window=W),
            SharedKVLayer("shared_kv", source=0)]


class WindowedDecoder(MixedDecoder):
    """Each layer attends from the embeddings x: attention over every earlier slot, sliding over the last W,
    shared over its source's keys and values with its own query and output weights."""

    def __init__(self, rng):
        self.pe = rng.standard_normal((64, H))
        self.w = {}
        for i, layer in enumerate(WINDOWED):
            d = WINDOWED[layer.source].dim if layer.kind == "shared_kv" else layer.dim
            self.w[i] = [rng.standard_normal((H, d)) for _ in range(3)] + [rng.standard_normal((d, H))]
        self.head = rng.standard_normal((H, V)) * 2
        self.calls = []

    @staticmethod
    def _window(mask, q_slots, k_slots, layer):
        if layer.kind == "sliding_attention":
            return mask + np.where(k_slots[None, :] <= q_slots[:, None] - layer.window, -np.inf, 0)
        return mask

    def _layers(self, x, keys, values, mask, q_slots, k_slots):
        h = x.copy()
        for i, layer in enumerate(WINDOWED):
            w, src = self.w[i], layer.source if layer.kind == "shared_kv" else i
            kind = WINDOWED[src]
            h += self._attend(w, x, keys[src], values[src], self._window(mask, q_slots, k_slots, kind))
        return h

    def full(self, x, positions):
        x = x + self.pe[positions]
        n = len(x)
        causal = np.triu(np.full((n, n), -np.inf), 1)
        kv = {i: (x @ self.w[i][1], x @ self.w[i][2]) for i, layer in enumerate(WINDOWED) if layer.kind != "shared_kv"}
        slots = np.arange(n)
        h = self._layers(x, {i: k for i, (k, _) in kv.items()}, {i: v for i, (_, v) in kv.items()}, causal, slots, slots)
        return h @ self.head

    def run(self, names, feeds):
        x = feeds["inputs_embeds"].astype(np.float64) + self.pe[feeds["position_ids"][0]]
        self.calls.append(x.shape[0])
        mask = feeds["attention_mask"]
        ar = x.shape[0]
        ctx = mask.shape[1] - ar
        slot = int((mask[0, :ctx] == 0).sum())
        q_slots = slot + np.arange(ar)
        k_slots = np.concatenate([np.arange(ctx), q_slots])
        out, keys, values = {}, {}, {}
        for i, layer in enumerate(WINDOWED):
            if layer.kind == "shared_kv":
                continue
            kn, vn = x @ self.w[i][1], x @ self.w[i][2]
            keys[i] = np.concatenate([feeds[layer.key_input], kn])
            values[i] = np.concatenate([feeds[layer.value_input], vn])
            out[layer.key_output], out[layer.value_output] = kn, vn
        logits = self._layers(x, keys, values, mask, q_slots, k_slots) @ self.head
        if "logit_rows" in feeds:
            logits = logits[feeds["logit_rows"]]
        out["logits"] = logits
        return [out[n].astype(np.float32) for n in names]


def make_windowed(one_graph: bool, lookahead: int = 0, ctx: int = 32):
    return engine(WindowedDecoder, 5, WINDOWED, one_graph, lookahead, ctx)


def test_windowed_and_shared_states_allocate_by_kind():
    c = KVCache(KVSpec(max_context=16, dtype="float32", layers=WINDOWED))
    assert [n for n, _, _ in c.inputs()] == ["k0", "v0", "k1", "v1", "k3", "v3"]
    assert c.output_names() == ["nk0", "nv0", "nk1", "nv1", "nk3", "nv3"]
    assert [b.data.shape for b in c.states["sliding_attention"].blocks] == [(2, 2, 16, 8)]  # layers 1 and 3: kv_dim 8
    assert c.nbytes == 4 * (2 * 16 * 8 + 2 * 2 * 16 * 8)


@pytest.mark.parametrize("one_graph", [False, True])
def test_windowed_layers_through_the_engine_equal_the_full_sequence(one_graph, monkeypatch):
    """Prompts past the window, kv and hybrid modes, a prefix reuse longer than the window and lookahead drafts (some
    rejected) over sliding-window and shared layers in the rows layout: the no-cache computation's ids."""
    engine, fake = make_windowed(one_graph)
    for prompt in ([3, 9, 4, 1, 2], [5, 1, 7, 7, 2, 8, 11, 4, 6], [4, 6, 8, 10, 12, 14, 16, 18, 2, 3, 5]):
        want = greedy(engine, fake, prompt, 8)
        assert len(set(want)) > 1
        for mode in ("kv", "hybrid"):
            assert list(engine.generate(engine.embed(prompt), mode=mode, max_new_tokens=8, ignore_eos=True)) == want
        start = engine.rows[0].reusable("hybrid", 8)
        got = list(engine.generate(engine.embed(prompt)[start:], mode="hybrid", max_new_tokens=8, ignore_eos=True,
                                   start=start))
        assert got == want
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    fast, fake = make_windowed(one_graph, lookahead=3)
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]
    want = greedy(fast, fake, prompt, 12)
    got = list(fast.generate(fast.embed(prompt), mode="kv", max_new_tokens=12, ignore_eos=True, prompt_ids=prompt))
    assert got == want and fast.last.drafted_tokens > 0
