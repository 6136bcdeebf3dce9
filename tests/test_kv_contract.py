"""The graph side (families/layers.py) and the host side (runtime/decode/kv_cache.py) of the KV cache agree.

The torch decoder run once over a whole sequence (empty cache) must give the same logits as the
same decoder stepped through the sequence with the runtime's KVCache writing the returned rows
and the runtime's attention_mask — in AR=1 steps and in padded AR=N blocks.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vlmrt.families.layers import CausalDecoder  # noqa: E402
from vlmrt.families.rope import Rope  # noqa: E402
from vlmrt.format.manifest import KVSpec, attention_layers  # noqa: E402
from vlmrt.runtime.decode.kv_cache import HEADS as HEADS_LAYOUT, KVCache, attention_mask  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, CTX = 2, 32, 4, 2, 8, 50, 24


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    d = CausalDecoder(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate=64,
                      eps=1e-5, act="silu", rope=Rope(theta=1e4), vocab=VOCAB).eval()
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / p.shape[1] ** 0.5)
    return d


def full_sequence_logits(decoder, x):
    n = x.shape[0]
    empty = [torch.zeros(0, KV_HEADS * HEAD_DIM) for _ in range(2 * LAYERS)]
    mask = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
    with torch.no_grad():
        return decoder(torch.from_numpy(x), torch.arange(n)[None], mask, *empty)[0].numpy()


def stepped_logits(decoder, x, ar):
    spec = KVSpec(max_context=CTX, dtype="float32", layers=attention_layers(LAYERS, KV_HEADS, HEAD_DIM, "k{layer}",
                                                                            "v{layer}", "nk{layer}", "nv{layer}"))
    cache = KVCache(spec)
    out = []
    for start in range(0, len(x), ar):
        block = x[start : start + ar]
        n = len(block)
        block = np.concatenate([block, np.zeros((ar - n, HIDDEN), np.float32)])  # padded last block
        pos = cache.length
        feeds = cache.feeds()
        past = [torch.from_numpy(feeds[f"{kv}{i}"]) for i in range(LAYERS) for kv in ("k", "v")]
        with torch.no_grad():
            logits, *rows = decoder(torch.from_numpy(block), torch.arange(pos, pos + ar)[None],
                                    torch.from_numpy(attention_mask(pos, ar, CTX)), *past)
        staged = [np.stack([r.numpy() for r in rows]).reshape(LAYERS, 2, ar, -1)]  # [layers, K/V, ar, dim]
        cache.store(staged, n, np.arange(pos, pos + ar)[None])
        out.append(logits.numpy()[:n])
    assert cache.length == len(x)
    return np.concatenate(out)


@pytest.mark.parametrize("ar", [1, 3, 4, 8])
def test_stepped_equals_full_sequence(decoder, ar):
    x = np.random.default_rng(ar).standard_normal((11, HIDDEN)).astype(np.float32)
    want = full_sequence_logits(decoder, x)
    got = stepped_logits(decoder, x, ar)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_stale_rows_beyond_length_are_ignored(decoder):
    """reset() keeps old rows; the mask must hide them."""
    x = np.random.default_rng(0).standard_normal((6, HIDDEN)).astype(np.float32)
    spec = KVSpec(max_context=CTX, dtype="float32", layers=attention_layers(LAYERS, KV_HEADS, HEAD_DIM, "k{layer}",
                                                                            "v{layer}", "nk{layer}", "nv{layer}"))
    cache = KVCache(spec)
    for buf in cache.keys + cache.values:
        buf[:] = 1e3  # garbage from an earlier request
    cache.reset()
    feeds = cache.feeds()
    past = [torch.from_numpy(feeds[f"{kv}{i}"]) for i in range(LAYERS) for kv in ("k", "v")]
    with torch.no_grad():
        got = decoder(torch.from_numpy(x), torch.arange(6)[None], torch.from_numpy(attention_mask(0, 6, CTX)),
                      *past)[0].numpy()
    np.testing.assert_allclose(got, full_sequence_logits(decoder, x), rtol=0, atol=2e-5)


def in_place_stepped_logits(decoder, x, blocks, garbage=False):
    """The gqa_in_place contract (families/gqa.py eager): the module writes each block's rows into the KVCache's
    HEADS buffers itself (PlainStep's copy of its slots stands for ORT's shared buffer); store only moves the
    length."""
    spec = KVSpec(max_context=CTX, dtype="float32", layers=attention_layers(LAYERS, KV_HEADS, HEAD_DIM, "k{layer}",
                                                                            "v{layer}", "pk{layer}", "pv{layer}"))
    cache = KVCache(spec, HEADS_LAYOUT)
    if garbage:
        cache.data[:] = 1e3  # stale rows of an earlier request: beyond the length, never read
    module = decoder.with_options(attention="gqa_in_place", logit_rows=True, rope_positions=CTX)
    out, start = [], 0
    for n in blocks:
        pos = cache.length
        past = [torch.from_numpy(b) for i in range(LAYERS) for b in (cache.keys[i], cache.values[i])]
        with torch.no_grad():
            logits, *present, top = module(torch.from_numpy(x[start : start + n]), torch.arange(pos, pos + n)[None],
                                           torch.tensor([pos + n - 1], dtype=torch.int32),
                                           torch.tensor(pos + n, dtype=torch.int32), *past, torch.arange(n))
        for j, p in enumerate(present):
            cache.data[j // 2, j % 2][..., pos : pos + n, :] = p.numpy()[..., pos : pos + n, :]
        cache.store([], n, np.arange(pos, pos + n)[None])  # (the graph wrote the rows: no staging)
        assert (top.numpy() == logits.numpy().argmax(-1)).all()  # next_token: the greedy choice of each row
        out.append(logits.numpy())
        start += n
    assert cache.length == len(x) and cache.stored().shape == (LAYERS, 2, len(x), KV_HEADS * HEAD_DIM)
    return np.concatenate(out), cache


@pytest.mark.parametrize("blocks", [[1] * 11, [4, 4, 3], [8, 1, 2], [11]])
def test_in_place_stepped_equals_full_sequence(decoder, blocks):
    x = np.random.default_rng(len(blocks)).standard_normal((11, HIDDEN)).astype(np.float32)
    got, cache = in_place_stepped_logits(decoder, x, blocks, garbage=True)
    np.testing.assert_allclose(got, full_sequence_logits(decoder, x), rtol=0, atol=2e-5)
    _, rows = in_place_stepped_logits(decoder, x, [11])
    np.testing.assert_allclose(cache.stored(), rows.stored(), rtol=0, atol=2e-5)  # the cache holds the same rows
