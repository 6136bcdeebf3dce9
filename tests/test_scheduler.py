"""The scheduler (runtime/decode/scheduler.py) on the tiny exported bundle: sequences that decode together through one
decoder call per round answer exactly what each answers alone (greedy ids, seeded sampling), with prompts of
several prefill blocks interleaved with the others' decode steps, sequences that start late and finish early; the
batch worker (`vlmrt batch`'s Answerer) answers as one VLM does, a failing record alone failing; the graph's batch
dimension (export/batch_dim.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from conftest import CASES, exported
from fixtures_tiny import alone, tiny  # noqa: F401  (fixtures)
from cpu_isa import plant_multi_row_rounding
from vlmrt.batch.worker import Answerer
from vlmrt.format.manifest import RowsDynamicKind
from vlmrt.runtime.answers import AnswerLoop
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.decode.decoder_kinds import decoder_kind
from vlmrt.runtime.decode.kv_cache import KVCache
from vlmrt.runtime.vlm import VLM
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig
from vlmrt.runtime.decode.sequence import Sequence


def _prompts(vlm, n):
    """n prompts of different lengths (1 to 5 prefill blocks of the tiny bundle's AR 8), as embeddings."""
    rng = np.random.default_rng(0)
    vocab = vlm.manifest.decoder.vocab_size
    return [rng.integers(0, vocab - 200, 3 + 9 * i).tolist() for i in range(n)]


# (max_new_tokens, sampling, the round it starts at): greedy and seeded sampling, late starts, early ends
PLAN = [(30, SamplingConfig(), 0), (12, SamplingConfig(temperature=0.9, seed=7), 0), (30, SamplingConfig(), 3),
        (25, SamplingConfig(temperature=0.8, top_k=20, seed=1), 6), (9, SamplingConfig(), 14)]


def test_sequences_decoding_together_answer_as_alone(tiny, alone):
    s0 = alone.scheduler
    prompts = _prompts(alone, len(PLAN))
    want = [list(s0.generate(s0.embed(p), max_new_tokens=n, sampler=Sampler(s), ignore_eos=True))
            for p, (n, s, _) in zip(prompts, PLAN)]
    sched = VLM.slots(Bundle.open(tiny.bundle), len(PLAN))[0].scheduler
    assert sched.batched and sched.probed is not None
    seqs, got = {}, [[] for _ in PLAN]
    for rnd in range(200):
        for i, (p, (n, s, at)) in enumerate(zip(prompts, PLAN)):
            if at == rnd:
                seqs[i] = sched.add(Sequence(sched.embed(p), max_new_tokens=n, sampler=Sampler(s), ignore_eos=True), i)
        sched.step()
        for i, seq in list(seqs.items()):
            got[i] += seq.take()
            if seq.done:
                del seqs[i]
        if not seqs and rnd > PLAN[-1][2]:
            break
    assert got == want
    assert sched.widest >= 4 and sched.calls < sum(len(w) for w in want) / 2  # they did decode together


def test_a_sequence_alone_decodes_through_the_batched_call(alone):
    """VLM.load's scheduler has one row and no other decode path: each decode step of a sequence alone is one call of
    the batched graph over its row (B = 1), as a round of n rows is one call over them; in kv mode the prompt's rows
    are one-row steps too, so the rows kept for a follow-up (CacheRow.reusable) grow with each decoded token."""
    s = alone.scheduler
    assert s.batched and len(s.rows) == 1 and s.probed is None and s.min_rows == 1
    calls = s.calls
    ids = list(s.generate(s.embed([5, 6, 7]), mode="kv", max_new_tokens=8, ignore_eos=True))
    assert len(ids) == 8 and s.calls - calls == 7 and s.widest == 1
    assert s.rows[0].reusable("kv", 3 + 7) == 3 + 7


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """LFM2-VL's gqa_in_place case: conv layers (two in a row, one last) beside a GroupQueryAttention layer."""
    from family_cases import LFM2_CASES, lfm2_exported

    return lfm2_exported(next(c for c in LFM2_CASES if c.name == "lfm2-conv-attn-conv-conv-gqa"), tmp_path_factory)


def test_lfm2_conv_layers_decode_together_and_answer_as_alone(lfm2):
    """An LFM2 bundle's graph takes a batch (its conv windows [B, width, channels] and rows [B, ar / B, channels],
    each sequence's window loaded from its own rows, its rows stored by it after the call); five sequences together
    (greedy and seeded sampling, late starts, early ends) answer as each alone."""
    m = Bundle.open(lfm2.bundle).manifest
    assert m.decoder.kind.batched and {layer.kind for layer in m.kv.layers} == {"conv", "attention"}
    g = onnx.load(str(lfm2.bundle / "decoder.onnx"), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*g.input, *g.output)}
    width, channels = m.kv.layers[0].width, m.kv.layers[0].channels
    assert dims["past_conv_0"] == ["batch", width, channels] and dims["new_conv_3"] == ["batch", "ar / batch", channels]
    # no view inside the layers keeps a baked sequence count of 1 (the q/k norms' [1, -1, h, d]: batch_dim)
    inits = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in g.initializer if i.data_type == onnx.TensorProto.INT64}
    shapes = [inits[n.input[1]] for n in g.node if n.op_type == "Reshape" and n.input[1] in inits]
    assert shapes and not [s for s in shapes if len(s) > 2 and s[0] == 1]
    test_sequences_decoding_together_answer_as_alone(lfm2, VLM.load(lfm2.bundle))


def test_qk_norm_views_take_the_batch(tmp_path_factory):
    """A Qwen3 decoder's per-head q/k norms are views the exporter bakes as [1, -1, heads, head_dim]: batch_dim makes
    them keep the batch (InternVL3.5's case, as LFM2's attention layers); five sequences answer as each alone."""
    from family_cases import CASES as INTERNVL, exported as internvl_exported

    ex = internvl_exported(next(c for c in INTERNVL if c.decoder == "qwen3"), tmp_path_factory)
    test_sequences_decoding_together_answer_as_alone(ex, VLM.load(ex.bundle))


def test_lfm2_idle_rows_keep_their_conv_rows(lfm2):
    """A row that waits for nothing in a call (here: row 1, after its answer) gets zero windows and its conv rows out
    are dropped: its kept conv rows and length stay as they were."""
    sched = VLM.slots(Bundle.open(lfm2.bundle), 2)[0].scheduler
    b = sched.rows[1]
    list(sched.generate(sched.embed([5, 6, 7, 8]), max_new_tokens=4, ignore_eos=True, row=1))
    kept, n = [c.data.copy() for c in b.cache.states["conv"].rows], b.cache.length
    list(sched.generate(sched.embed([9, 10, 11]), max_new_tokens=5, ignore_eos=True, row=0))
    assert b.cache.length == n and all(np.array_equal(c.data, k) for c, k in zip(b.cache.states["conv"].rows, kept))


def test_fp16_graph_takes_a_batch_and_answers_as_alone(tiny, tmp_path_factory):
    """--dtype fp16: its graph's norm is not fused (a Cast first), and the batch dimension still goes in where
    inputs_embeds enters the layers (export/batch_dim.py); five sequences together answer as each alone."""
    from vlmrt.export.pipeline import export

    c = tiny.case
    b16 = export(str(tiny.ckpt), tmp_path_factory.mktemp("fp16") / "b", prefill_ar=c.prefill_ar,
                 max_seq_len=c.max_seq_len, dtype="fp16", progress=False)
    alone16 = VLM.load(b16)
    assert alone16.manifest.decoder.kind.batched
    test_sequences_decoding_together_answer_as_alone(dataclasses.replace(tiny, bundle=b16), alone16)


def test_a_full_idle_row_keeps_its_rows_but_the_last(tiny, alone):
    """A row that waits for nothing is computed too: its junk K/V row goes one past what its cache keeps, or for a
    full cache onto its last slot (which it then no longer keeps)."""
    sched = VLM.slots(Bundle.open(tiny.bundle), 2)[0].scheduler
    a = sched.rows[0]
    top = a.kv_spec.max_context
    list(sched.generate(sched.embed(_prompts(alone, 1)[0]), max_new_tokens=top, ignore_eos=True, row=0))  # fills up
    kept = a.cache.stored().copy()
    assert a.cache.length == top
    list(sched.generate(sched.embed([5, 6, 7]), max_new_tokens=3, ignore_eos=True, row=1))
    assert a.cache.length == top - 1 and np.array_equal(a.cache.stored(), kept[:, :, : top - 1])


@pytest.mark.parametrize("case, sizes", [(1, [(30, 30), (34, 30), (38, 30)]), (0, [(150, 100)])],
                         ids=["three-one-tile-images", "one-image-of-seven-tiles"])
def test_images_of_a_new_prompt_are_encoded_between_the_others_steps(case, sizes, tmp_path_factory):
    """In the answer loop a prompt's images are encoded one vision call (one tile) per round, so the others' decode
    steps go on between them, a many-tile image included; the answer is the one alone."""
    from PIL import Image

    rng = np.random.default_rng(3)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    msgs = [{"role": "user", "content": [*({"type": "image", "image": im} for im in ims),
                                         {"type": "text", "text": "what is it?"}]}]
    bundle = exported(CASES[case], tmp_path_factory).bundle
    want = "".join(VLM.load(bundle).chat(msgs, max_new_tokens=6))
    vlms = VLM.slots(Bundle.open(bundle), 2)
    sched = vlms[0].scheduler
    other = sched.add(Sequence(sched.embed([5, 6, 7]), max_new_tokens=200, ignore_eos=True), 1)
    sched.step()  # the other sequence: its prompt, its first token
    loop = AnswerLoop(vlms)
    loop.begin(vlms[0].chat_answer(msgs, max_new_tokens=6))
    got, rounds = [], 0
    while loop.busy:
        n = sched.rows[1].cache.length
        events = loop.round()
        assert sched.rows[1].cache.length == n + 1 and not other.done  # the other decoded a token in this round
        got += [v for _, kind, v in events if kind == "piece"]
        rounds += not got
    st = vlms[0].result.stats
    blocks = -(-st.prompt_tokens // vlms[0].manifest.decoder.prefill_ar)
    assert "".join(got) == want and st.images == len(sizes) and st.image_tiles >= 3
    # a round for each vision call (tile) but the last, and for each prefill block but the last
    assert rounds == st.image_tiles - 1 + blocks - 1


@pytest.mark.parametrize("by_width", [False, True], ids=["one-row-apart", "every-width-apart"])
def test_calls_that_round_apart_by_width_are_probed_and_answers_do_not_depend_on_the_load(tiny, monkeypatch, by_width):
    """A decoder whose one-row calls compute a row differently from its multi-row calls (planted: cpu_isa.py
    MultiRowRounding, as MLAS's int8 kernels on an AVX2-only CPU) or whose every call width does: the probe at load
    finds it and pads the calls (min_rows 2: a sequence alone runs with an idle row; every width apart: every call
    over all rows), so each sequence answers alone (row 0, as a server's lowest free slot) as it does among others,
    greedy and seeded. Before the probe a sequence alone ran one-row calls and answered otherwise."""
    planted = plant_multi_row_rounding(monkeypatch, scale=0.1, by_width=by_width)
    vlms = VLM.slots(Bundle.open(tiny.bundle), 4)
    sched = vlms[0].scheduler
    prompts = _prompts(vlms[0], 4)
    plan = [(20, SamplingConfig()), (20, SamplingConfig(temperature=0.9, seed=7)), (24, SamplingConfig()),
            (16, SamplingConfig(temperature=0.8, top_k=20, seed=1))]

    def seq(i):
        return Sequence(sched.embed(prompts[i]), max_new_tokens=plan[i][0], sampler=Sampler(plan[i][1]), ignore_eos=True)

    alone = []
    for i in range(4):
        s = sched.add(seq(i), 0)
        while not s.done:
            sched.step()
        alone.append(s.ids)
    together = [sched.add(seq(i), i) for i in range(4)]
    while sched.running:
        sched.step()
    assert [s.ids for s in together] == alone
    assert sched.widest == 4 and planted[0].calls > 0
    p = sched.probed
    assert p["one_row_diff"] > 0 and p["invariant"] and p["neighbour_diff"] == 0
    assert (p["multi_row_diff"] > 0, p["min_rows"]) == ((True, 4) if by_width else (False, 2))


def test_batch_worker_answers_as_one_vlm_and_a_bad_record_fails_alone(tiny, alone):
    opts = {"max_new_tokens": 10}
    long = "word " * 400  # over the tiny bundle's context (320)
    requests = [{"id": i, "messages": [{"role": "user", "content": text}]} for i, text in
                enumerate(["hi", "What is this?", long, "Tell me more about it.", "ok", "a b c d e f g h i j k"])]
    w = Answerer(str(tiny.bundle), options=opts, sequences=3)
    assert w.scheduler.probed is not None
    lines = {r["id"]: r for r in w.answers(requests)}
    assert "max context" in lines[2]["error"]
    for r in requests:
        if r["id"] != 2:
            alone.reset()
            assert lines[r["id"]]["text"] == "".join(alone.chat(r["messages"], **opts)), r["id"]
            assert lines[r["id"]]["token_ids"] == alone.result.token_ids


def test_a_batched_call_that_raises_fails_the_records_it_advanced(tiny, monkeypatch):
    w = Answerer(str(tiny.bundle), options={"max_new_tokens": 6}, sequences=2)
    calls = {"n": 0}
    call = w.scheduler.batch_call

    def flaky(pending):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bad call")
        return call(pending)

    monkeypatch.setattr(w.scheduler, "batch_call", flaky)
    lines = list(w.answers([{"id": i, "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(3)]))
    errors = [r for r in lines if "error" in r]
    assert len(lines) == 3 and len(errors) == 2
    assert all(r["error"] == "batched decode step failed: RuntimeError: a bad call" for r in errors)
    assert "text" in next(r for r in lines if "error" not in r)  # the third record, started after, is answered


def test_the_graph_takes_a_batch(tiny):
    m = onnx.load(str(tiny.bundle / "decoder.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    assert dims["seqlens_k"] == ["batch"] and dims["past_key_0"][0] == "batch"
    assert Bundle.open(tiny.bundle).manifest.decoder.kind.batched
    one = VLM.slots(Bundle.open(tiny.bundle), 1)[0].scheduler
    assert one.batched and one.probed is None and one.min_rows == 1  # one row: one-row calls, nothing to probe


def test_rows_kinds_take_one_sequence_per_call(tiny):
    """The rows kinds (the NPU target's static graphs, --attention portable) have no batch: the scheduler runs their
    rows one per call (test_family_conformance.py: their conversations through it answer as alone)."""
    m = Bundle.open(tiny.bundle).manifest
    rows = dataclasses.replace(m.decoder, kind=RowsDynamicKind("rows_dynamic", "attention_mask", 64, "logit_rows"))
    with pytest.raises(ValueError, match="one sequence per call"):
        decoder_kind(rows, m.kv).batch_inputs(2)
    blocks = KVCache.batch_blocks(m.kv, 3)
    assert blocks[0].shape[2] == 3 and KVCache.rows_of(blocks, 1)[0].shape[2] == 1
