"""The runtime's speed paths give the same answers as the plain ones, and the CPU graphs have the shape they
are meant to have. No timings are asserted here (benchmarks/compare.py measures them)."""

import dataclasses

import onnx
import onnxruntime as ort
import pytest

import vlmrt
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.weights import SharedWeights
from vlmrt.runtime.vlm import VLM
from vlmrt.runtime.decode.step import BoundStep


class RunOnly:
    """An ORT session seen through run() alone, as the engine sees the reference's torch modules: it takes the
    plain step path (runtime/decode/step.py PlainStep) instead of binding."""

    def __init__(self, session):
        self.session = session

    def run(self, names, feeds):
        return self.session.run(names, feeds)


def _load(bundle, bind: bool):
    b = Bundle.open(bundle)
    if not bind:
        b = dataclasses.replace(b, sessions={k: RunOnly(v) for k, v in b.sessions.items()})
    return VLM(b)


def _answer(bundle, bind: bool, mode: str, image=None):
    vlm = _load(bundle, bind)
    r = vlm("Describe the picture in detail.", image, mode=mode, max_new_tokens=12, ignore_eos=True)
    return r.token_ids, vlm.row.cache.stored().copy(), vlm.scheduler.last


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_io_binding_equals_plain_run(default_bundle, mode):
    """Bound steps (OrtValues over the cache, reused I/O buffers) = session.run."""
    ids_a, cache_a, _ = _answer(default_bundle.bundle, False, mode)
    ids_b, cache_b, stats = _answer(default_bundle.bundle, True, mode)
    assert ids_a == ids_b
    assert (cache_a == cache_b).all()
    assert 0 <= stats.decode_run_s <= stats.decode_s
    assert stats.host_overhead_ms_per_step >= 0


def test_bound_steps_do_not_multiply_with_prompt_lengths(default_bundle):
    """One graph with a symbolic AR: only decode steps and full prefill blocks get bound steps (one per context
    length), and those of one AR share their buffers; a prompt's short last block runs plain. Prompts of many
    lengths leave at most two sets of buffers, and their answers equal the plain path's."""
    vlm = _load(default_bundle.bundle, True)
    dec = vlm.manifest.decoder
    assert dec.kind.name == "gqa_in_place"  # (symbolic AR)
    bound = {}
    for words in range(1, 40, 3):
        bound[words] = vlm("word " * words, None, max_new_tokens=4, ignore_eos=True).token_ids
    kept = vlm.row._steps
    assert all(isinstance(s, BoundStep) for s in kept.values())
    assert {ar for _, _, ar, _ in kept} <= {1, dec.prefill_ar} and len(vlm.row._buffers) <= 2
    plain = _load(default_bundle.bundle, False)
    for words, ids in bound.items():
        assert plain("word " * words, None, max_new_tokens=4, ignore_eos=True).token_ids == ids


def test_score_keeps_rows_with_io_binding(default_bundle):
    """score() stacks logits rows; with bound steps each row must be a copy, not the reused buffer."""
    import numpy as np

    vlm = _load(default_bundle.bundle, True)
    ids = vlm.prompt("Hello there").ids
    rows = vlm.row.score(vlm.scheduler.embed(ids), [5, 6, 7, 8], mode="hybrid")
    assert not np.allclose(rows[0], rows[-1])


def _optimized(bundle, graph, tmp_path):
    """The graph as ORT runs it on the CPU EP (after its own fusions)."""
    from conftest import graph_path

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / f"{graph}.opt.onnx")
    from vlmrt.format import manifest as mf

    shared = SharedWeights(bundle)
    for k, v in shared.initializers(mf.load(bundle, verify=False).graphs[graph]).items():
        so.add_initializer(k, v)
    ort.InferenceSession(str(graph_path(bundle, graph)), so, providers=["CPUExecutionProvider"])
    return onnx.load(so.optimized_model_filepath, load_external_data=False)


def cache_readers(bundle, tmp_path) -> set[str]:
    """The op types that read the past K/V inputs of the optimized decode graph (every input is read); RMSNorm is
    ORT's fused kernel there."""
    m = _optimized(bundle, "decode", tmp_path)
    past = {i.name for i in m.graph.input if i.name.startswith("past_")}
    consumers = {}
    for n in m.graph.node:
        for i in n.input:
            if i in past:
                consumers.setdefault(i, []).append(n.op_type)
    assert set(consumers) == past
    ops = {n.op_type for n in m.graph.node}
    assert "SimplifiedLayerNormalization" in ops or "SkipSimplifiedLayerNormalization" in ops
    assert "ReduceMean" not in ops
    return {op for ops in consumers.values() for op in ops}


def test_decode_graph_reads_the_cache_in_place(default_bundle, tmp_path):
    """The default CPU decoder's cache buffers go only into GroupQueryAttention (kind gqa_in_place), which reads
    them where they are and writes the step's rows into them. The portable form (--attention portable) feeds every
    past input straight into a MatMul (q·Kᵀ as FusedMatMul transB), no Concat, Transpose or other copy of the cache
    per step (CachedGQAttention._copy_free_step): test_gqa.py checks that one on its portable export."""
    assert cache_readers(default_bundle.bundle, tmp_path) == {"GroupQueryAttention"}


def test_symbolic_context_graphs_equal_static_ones(default_bundle, tmp_path_factory, monkeypatch):
    """The default CPU export is one decoder graph for prefill and decode, GroupQueryAttention over in_place cache
    buffers (test_gqa.py: equal to the portable graph, symbolic in the cache length, where steps read the prefix of
    the cache they need: kind rows_dynamic's context_step) and symbolic in AR (a step feeds
    exactly its tokens; logit_rows: only the rows' logits it asks for, the last one's), loaded as one session. Same checkpoint
    exported static (--context-step 0: two graphs, padded prefill blocks): identical tokens; cache rows and logits
    equal to float rounding (the AR=1 step's own-key product is a MatMul over a symbolic AR instead of the static
    graph's folded form; measured on this fixture: cache max abs diff 6.4e-6 on values up to 7.2, logits 2.7e-6)."""
    import numpy as np

    from conftest import image_file
    from vlmrt.export.pipeline import export

    c = default_bundle.case
    m = default_bundle.manifest()
    # the default: GroupQueryAttention over whole in_place buffers (test_gqa.py compares it with the portable graph,
    # symbolic in the cache length)
    assert m["decoder"]["kind"]["name"] == "gqa_in_place"
    dec_in = {t["name"]: t["shape"] for t in m["graphs"]["decode"]["inputs"]}
    layer = m["kv"]["layers"][0]
    # the buffers and seqlens_k lead with the batch (export/batch_dim.py: one call may advance several sequences)
    assert m["decoder"]["kind"]["batched"] is True
    assert dec_in["past_key_0"] == ["batch", layer["kv_heads"], c.max_seq_len, layer["head_dim"]]
    assert dec_in["inputs_embeds"][0] == "ar" and dec_in["seqlens_k"] == ["batch"] and dec_in["total_sequence_length"] == []
    assert dec_in["position_ids"] == [1, "ar"]  # the rope positions, apart from the slots (seqlens_k)
    assert m["graphs"]["prefill"]["file"] == m["graphs"]["decode"]["file"] == "decoder.onnx"
    assert m["decoder"]["kind"]["logit_rows_input"] == "logit_rows"
    assert {t["name"]: t["shape"] for t in m["graphs"]["decode"]["outputs"]}["logits"] == ["rows", m["decoder"]["vocab_size"]]
    assert dec_in["logit_rows"] == ["rows"]
    static = export(str(default_bundle.ckpt), tmp_path_factory.mktemp("static") / "b", prefill_ar=c.prefill_ar,
                    max_seq_len=c.max_seq_len, context_step=0, progress=False)
    ms = vlmrt.load(static).manifest
    assert ms.decoder.kind.name == "rows_static" and ms.decoder.kind.context_step == 0
    assert ms.graphs["decode"].input("past_key_0").shape[0] == c.max_seq_len
    assert ms.graphs["prefill"].file == "prefill.onnx"
    img = image_file("chelsea.png", None)
    for mode in ("hybrid", "kv"):
        a, b = vlmrt.load(default_bundle.bundle), vlmrt.load(static)
        assert a.bundle.sessions["prefill"] is a.bundle.sessions["decode"]  # one session, one copy of the weights
        ra = a("Describe the picture in detail.", img, mode=mode, max_new_tokens=12, ignore_eos=True)
        rb = b("Describe the picture in detail.", img, mode=mode, max_new_tokens=12, ignore_eos=True)
        assert ra.stats.prompt_tokens > 64  # the prompt spans several context steps
        assert ra.token_ids == rb.token_ids
        np.testing.assert_allclose(a.row.cache.stored(), b.row.cache.stored(), rtol=0, atol=5e-5)
        ids = a.prompt("Hello there").ids
        la = a.row.score(a.scheduler.embed(ids), [5, 6, 7], mode=mode)
        lb = b.row.score(b.scheduler.embed(ids), [5, 6, 7], mode=mode)
        np.testing.assert_allclose(la, lb, rtol=0, atol=2e-5)


def test_embedding_rows_read_with_pread_equal_the_table(default_bundle, tmp_path):
    """Bundle.embed_table reads rows with pread (a memory map would count ~64 KB of RSS per touched row):
    the same rows as the .npy in any order, repeats included; an id outside the vocabulary is an error."""
    import numpy as np

    from vlmrt.format.manifest import BundleError
    from vlmrt.runtime.weights import EmbeddingRows

    path = default_bundle.bundle / default_bundle.manifest()["decoder"]["embedding_file"]
    want = np.load(path)
    table = EmbeddingRows(path)
    assert table.shape == want.shape and table.dtype == want.dtype
    ids = [0, want.shape[0] - 1, 7, 7, 3]
    assert (table[ids] == want[ids]).all() and table[[]].shape == (0, want.shape[1])
    for bad in ([-1], [want.shape[0]]):
        with pytest.raises(IndexError):
            table[bad]
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((4, 3), np.float32)))
    with pytest.raises(BundleError, match="C-ordered"):
        EmbeddingRows(tmp_path / "f.npy")
