"""The decode loop's host fast paths equal the general ones: the kept mask (StepMask), the token row written in
place (TokenEmbedding.into / CacheRow.step_token), the int8 row read into the graph's token_rows input (the graph scales it),
the one-row KV write. Greedy ids through them: test_engine_fake.py, test_runtime_speed_paths.py, test_kv_contract.py."""

import numpy as np
import pytest

from vlmrt.format import manifest as mf
from vlmrt.format.manifest import KVSpec, attention_layers
from vlmrt.runtime.weights import EmbeddingRows
from vlmrt.runtime.decode.step_features import StepMask
from vlmrt.runtime.decode.embedding import TokenEmbedding
from vlmrt.runtime.decode.kv_cache import KVCache, attention_mask

from test_engine_fake import make_engine
from test_quant import bundle
from test_runtime_speed_paths import RunOnly


@pytest.mark.parametrize("ar,ctx,neg", [(1, 64, None), (4, 24, None), (3, 16, -30.0)])
def test_kept_mask_equals_a_fresh_one(ar, ctx, neg):
    rng = np.random.default_rng(0)
    m = StepMask("attention_mask", ar, ctx, np.float32, neg)
    pos = 0
    for _ in range(200):  # mostly forward by one (decode), sometimes a jump or a rewind (a new request)
        pos = int(rng.integers(0, ctx + 1)) if rng.random() < 0.2 else min(ctx, pos + 1)
        want = attention_mask(pos, ar, ctx, np.float32, neg=neg)
        m.set(pos)
        np.testing.assert_array_equal(m.array, want)


def test_token_row_in_place_equals_embed(default_bundle, tmp_path):
    """int8 rows x scale read by EmbeddingRows (pread), the bundle's table, a float ndarray; float32 and float16."""
    m = mf.load(default_bundle.bundle, verify=False)
    rng = np.random.default_rng(1)
    vocab, hidden = m.decoder.vocab_size, m.decoder.hidden_size
    np.save(tmp_path / "q.npy", rng.integers(-127, 128, (vocab, hidden)).astype(np.int8))
    scale = rng.uniform(0.001, 0.1, vocab).astype(np.float32)
    tables = [(EmbeddingRows(tmp_path / "q.npy"), scale), (EmbeddingRows(default_bundle.bundle / m.decoder.embedding_file), None),
              (rng.standard_normal((vocab, hidden)).astype(np.float32), None)]
    for tab, sc in tables:
        for dtype in ("float32", "float16"):
            e = TokenEmbedding(tab, sc, dtype)
            for t in (0, 1, 17, vocab - 1):
                out = np.empty(hidden, dtype)
                e.into(t, out)
                np.testing.assert_array_equal(out, e.embed([t])[0])
            with pytest.raises(IndexError):
                e.into(vocab, out)


def test_int8_row_read_into_equals_row(tmp_path):
    """EmbeddingRows.read_into (a decode step's pread into the bound int8 input) and the ndarray table's reader."""
    from vlmrt.runtime.decode.embedding import _ndarray_reader

    q = np.random.default_rng(2).integers(-127, 128, (50, 24)).astype(np.int8)
    np.save(tmp_path / "q.npy", q)
    for read in (EmbeddingRows(tmp_path / "q.npy").read_into, _ndarray_reader(q)):
        for t in (0, 7, 49):
            out = np.full(24, 99, np.int8)
            read(t, memoryview(out))
            np.testing.assert_array_equal(out, q[t])


@pytest.mark.parametrize("bind", [True, False])
def test_token_rows_step_equals_embeds_step(tmp_path_factory, bind):
    """An int8-table decoder takes a decode step's row unscaled (decoder.token_rows_input): the graph's float32
    row x scale gives bit for bit the logits, argmax and cache rows of the host's own multiply fed as inputs_embeds,
    step after step and across switches between the two (a kv-mode prompt, lookahead drafts and image rows come as
    inputs_embeds), bound and plain; greedy answers through it equal the host-multiply path's."""
    from vlmrt.runtime.vlm import VLM

    b = bundle("w4a8", tmp_path_factory)
    vlm = VLM.load(b, verify=False)
    d = vlm.manifest.decoder
    assert d.kind.token_rows_input == "token_rows" and d.kind.token_scales_input == "token_scales"
    if not bind:
        vlm.row.sessions.decode = vlm.row.sessions.prefill = RunOnly(vlm.bundle.sessions["decode"])
    e = vlm.row
    assert e.embedding.int8_rows  # the token path is what step_token takes
    e.prefill(e.embed([3, 5, 7, 11, 2, 9]), "kv")
    for t in (4, 9, 9, 1, 22, 0, 13, vlm.manifest.decoder.vocab_size - 1):
        n = e.cache.length
        a, am = e.step_token(t).copy(), list(e._argmax)
        ka = e.cache.stored(n + 1).copy()
        e.cache.rewind(n)
        bl = e.step("decode", e.embed([t]))[-1].copy()
        np.testing.assert_array_equal(a, bl)
        np.testing.assert_array_equal(am, e._argmax)
        np.testing.assert_array_equal(ka, e.cache.stored(n + 1))
    with pytest.raises(IndexError):
        e.step_token(d.vocab_size)
    plain = VLM.load(b, verify=False)
    plain.scheduler.embedding.int8_rows = False  # the host multiply into inputs_embeds (the graph adds a zero-scaled row)
    for prompt in ("Describe the picture in detail.", "word " * 40):
        for mode in ("kv", "hybrid"):
            ids = vlm(prompt, None, mode=mode, max_new_tokens=16, ignore_eos=True).token_ids
            assert ids == plain(prompt, None, mode=mode, max_new_tokens=16, ignore_eos=True).token_ids


def test_step_token_equals_step_of_embed():
    a, b = (make_engine(one_graph=True, context_step=8)[0].rows[0] for _ in range(2))
    ids = [3, 5, 7, 11, 2]
    a.prefill(a.embed(ids), "hybrid")
    b.prefill(b.embed(ids), "hybrid")
    for t in (4, 9, 9, 1, 22, 0, 13):
        np.testing.assert_array_equal(a.step_token(t), b.step("decode", b.embed([t]))[-1])
    np.testing.assert_array_equal(a.cache.data, b.cache.data)


def test_one_row_write_equals_block_write():
    spec = KVSpec(max_context=6, dtype="float32", layers=attention_layers(3, 2, 2))
    a, b = KVCache(spec), KVCache(spec)
    rng = np.random.default_rng(0)
    for p in range(6):
        rows = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
        a.store([rows], 1, np.array([[p + 10, p + 11]]))
        b.data[:, :, b.length : b.length + 1] = rows[:, :, :1]
        b.length += 1
    np.testing.assert_array_equal(a.data, b.data)
    assert list(a.positions[0]) == [10, 11, 12, 13, 14, 15] and a.next_position() == 16
    with pytest.raises(OverflowError):
        a.store([rows], 1, np.zeros((1, 2), np.int64))
