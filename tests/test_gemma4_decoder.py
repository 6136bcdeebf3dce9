"""Gemma 4's text decoder (families/gemma4) exported as the CPU's gqa_in_place graph and run through the real cache
(windowed_attention / sliding_attention, attention and shared_kv state kinds: runtime/decode/windowed_state.py) and
scheduler, against transformers' Gemma4ForCausalLM on tiny random checkpoints built with its own classes: 24 greedy
ids equal `generate` in kv and hybrid modes on prompts several windows long (prefill blocks of 4 crossing the
evictions of the windowed cache: window + 4 rows, 5 slots between evictions), a follow-up turn reusing a prefix
longer than the window (restored from a snapshot), lookahead drafts (rejected ones across an eviction run again), and
three conversations batched answering as alone.

Two checkpoints: "shared" (a 2:1 sliding / full pattern, window 5, 2 kv-shared layers with double-wide MLPs,
per-layer inputs, attention_k_eq_v with its own kv heads and global_head_dim on the full layers, proportional RoPE,
logit soft-capping) and "plain" (a 1:1 pattern, window 3, no sharing, no per-layer inputs, no soft-capping), both
saved by transformers (per_layer_config, not global_head_dim). Each decoder is exported once per session; "shared"
once more with the 8-bit cache (`--kv-cache int8`: every path against a fresh int8 run, the logits against the float
cache's within measured bounds)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from vlmrt.export import cache_kinds, fuse, graphs
from vlmrt.families.gemma4 import language
from vlmrt.families.gemma4.config import Gemma4TextConfig
from vlmrt.families.weights import Tensors
from vlmrt.format.manifest import AttentionLayer, DecoderSpec, GqaInPlaceKind, KVSpec, PositionsSpec, RowsDynamicKind
from vlmrt.runtime.decode import lookahead
from vlmrt.runtime.decode.cache_row import DecoderConfig, DecoderSessions
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig
from vlmrt.runtime.decode.scheduler import Scheduler
from vlmrt.runtime.decode.sequence import Sequence

AR, CTX, N = 4, 96, 24

CONFIGS = {
    "shared": dict(num_hidden_layers=6, sliding_window=5, global_head_dim=32, num_global_key_value_heads=1,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                "sliding_attention", "full_attention"],
                   num_kv_shared_layers=2, hidden_size_per_layer_input=8, attention_k_eq_v=True,
                   use_double_wide_mlp=True, final_logit_softcapping=30.0),
    "plain": dict(num_hidden_layers=4, sliding_window=3, global_head_dim=16,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                  num_kv_shared_layers=0, hidden_size_per_layer_input=0, final_logit_softcapping=None),
}
PROMPTS = [[2, 17, 43, 9, 88, 5, 120, 61, 7, 7, 33, 250, 11],  # 13 tokens: longer than both windows
           [2, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [2, 30, 31, 30, 31, 30, 31, 30]]


def _checkpoint(name: str, folder):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig as HFConfig

    cfg = HFConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size_per_layer_input=300, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                   max_position_embeddings=512, **CONFIGS[name])
    torch.manual_seed(7)
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():  # weights a random init leaves at 1 / small: spread, so greedy ids have clear margins
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and "embed" not in n:
                p.mul_(5)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    model.save_pretrained(folder)  # (config.json as transformers writes it: per_layer_config, no global_head_dim)
    return model, json.loads((folder / "config.json").read_text())


class Exported:
    def __init__(self, model, config: dict, path, attention: str = "gqa_in_place"):
        self.model, self.path, self.attention = model, path, attention
        self.text = Gemma4TextConfig.from_hf(config)
        sd = model.state_dict()
        self.decoder, table = language.load(self.text, Tensors(sd), "model.")
        self.decoder.window_capacity = graphs.window_capacity(self.decoder, attention, AR)  # (as the pipeline's)
        self.table = table.rows(0, self.text.vocab)
        graphs.export_decoder(self.decoder, attention=attention, ar=AR, max_context=CTX,
                              hidden=self.table.shape[1],
                              io_dtype="fp32", precision="fp32", head="fp32", path=path, dynamic_context=True,
                              dynamic_ar=True)
        self.session = _session(path)
        self.layers = cache_kinds.kv_layers(self.decoder, self.text, graphs.LAYOUTS[attention].out_prefix)

    def int8(self, path) -> "Exported":
        """The same decoder with the 8-bit cache (`--kv-cache int8`): its scales calibrated as the pipeline's
        (_int8_layers), the graph's GroupQueryAttention nodes edited as export_decoder's last pass does
        (kv_quant.quantize_cache on this graph: no second export)."""
        import copy

        from vlmrt.export.cpu import kv_quant

        new = copy.copy(self)
        new.layers = _int8_layers(self.decoder, self.table, self.layers)
        model = onnx.load(str(self.path))
        kv_quant.quantize_cache(model, [x for x in new.layers if isinstance(x, AttentionLayer) and x.quant])
        onnx.save(model, str(path))
        new.path, new.session = path, _session(path)
        return new

    def scheduler(self, rows: int = 1, lookahead: int = 0, session=None) -> Scheduler:
        kind = (GqaInPlaceKind(name="gqa_in_place", seqlens_input="seqlens_k", total_length_input="total_sequence_length",
                               logit_rows_input="logit_rows", argmax_output="next_token",
                               batched=cache_kinds.batchable(self.decoder.layer_kinds))
                if self.attention == "gqa_in_place" else
                RowsDynamicKind(name="rows_dynamic", mask_input="attention_mask", context_step=8,
                                logit_rows_input="logit_rows"))
        dec = DecoderSpec(hidden_size=self.table.shape[1], vocab_size=self.text.vocab, prefill_ar=AR,
                          embeds_input="inputs_embeds", positions=PositionsSpec("position_ids"), logits_output="logits",
                          embedding_file="embed.npy", embedding_dtype="float32", kind=kind)
        kv = KVSpec(max_context=CTX, dtype="float32", layers=self.layers)
        session = session or self.session
        return Scheduler(DecoderSessions(decode=session, prefill=session),
                         DecoderConfig(kv, dec, [1], lookahead=lookahead), self.table, rows=rows)

    def generate(self, ids: list[int]) -> list[int]:
        """transformers' greedy answer of N tokens (EOS not a stop)."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        return out[0, len(ids):].tolist()


def _session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _int8_layers(decoder, table: np.ndarray, layers: list) -> list:
    """kv.layers with the 8-bit cache's scales, calibrated as the pipeline's (export/pipeline.py _kv_quant): the float
    decoder's rows over prompts (6 of 40 random ids) and 8 greedy tokens each (288 rows)."""
    import dataclasses

    from vlmrt.export.cpu import kv_quant

    rng = np.random.default_rng(5)
    ids = [[2, *rng.integers(3, table.shape[0], 39).tolist()] for _ in range(6)]
    absmax, rows = kv_quant.calibrate(decoder, table, ids, 8)
    quants = iter(kv_quant.scales(absmax, rows, 8))
    return [dataclasses.replace(x, quant=next(quants)) if isinstance(x, AttentionLayer) else x for x in layers]


@pytest.fixture(scope="session", params=[("shared", "gqa_in_place"), ("plain", "gqa_in_place"),
                                        ("shared", "rows_copy_free")], ids=lambda p: "-".join(p))
def gemma4(request, tmp_path_factory):
    return _exported(*request.param, 0, tmp_path_factory)


_EXPORTS: dict[tuple, Exported] = {}


def _exported(name: str, attention: str, kv_bits: int, tmp_path_factory) -> Exported:
    """A checkpoint's decoder exported once per session (the fixtures share them)."""
    key = (name, attention, kv_bits)
    if key not in _EXPORTS:
        folder = tmp_path_factory.mktemp(f"gemma4-{name}-{attention}-{kv_bits}")
        if kv_bits:
            _EXPORTS[key] = _exported(name, attention, 0, tmp_path_factory).int8(folder / "decoder.onnx")
        else:
            model, config = _checkpoint(name, folder)
            _EXPORTS[key] = Exported(model, config, folder / "decoder.onnx", attention)
    return _EXPORTS[key]


def test_manifest_layers_name_their_kinds(gemma4):
    """kv.layers: the sliding layers with their window, the full ones with their own shape, the shared ones naming
    the last earlier layer of their type that has K/V (transformers' kv_sharing_modes "store" layer)."""
    kinds = [layer.kind for layer in gemma4.layers]
    shapes = gemma4.text.shapes
    assert kinds == list(gemma4.decoder.layer_kinds)
    for layer, shape in zip(gemma4.layers, shapes):
        if layer.kind == "shared_kv":
            assert shapes[layer.source].type == shape.type and shapes[layer.source].shares < 0
        else:
            assert (layer.kv_heads, layer.head_dim) == (shape.kv_heads, shape.head_dim)
        if shape.type == "sliding_attention" and shape.shares < 0:  # gqa_in_place: a windowed cache of window + AR rows
            assert layer.window == gemma4.text.window
            windowed = gemma4.attention == "gqa_in_place"
            assert layer.kind == ("windowed_attention" if windowed else "sliding_attention")
            assert not windowed or layer.capacity == gemma4.text.window + AR
    if gemma4.attention == "gqa_in_place":
        import onnx

        g = onnx.load(str(gemma4.path), load_external_data=False).graph
        window = {n.name: {a.name: a.i for a in n.attribute} for n in g.node if n.op_type == "GroupQueryAttention"}
        assert sorted(a.get("sliding_window_cache", 0) for a in window.values()) == sorted(
            int(s.type == "sliding_attention") for s in shapes)
        dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
        for layer in gemma4.layers:
            if layer.kind == "windowed_attention":
                assert dims[layer.key_input][1:] == [layer.kv_heads, layer.capacity, layer.head_dim]


def test_greedy_ids_equal_generate_in_both_modes(gemma4):
    sched = gemma4.scheduler()
    for ids in PROMPTS:
        want = gemma4.generate(ids)
        assert len(set(want)) > 3
        for mode in ("kv", "hybrid"):
            got = list(sched.generate(sched.embed(ids), mode=mode, max_new_tokens=N, ignore_eos=True))
            assert got == want, (mode, ids)


def test_follow_up_reuses_the_prefix(gemma4):
    """A second turn that keeps the first turn's rows (past the window) and feeds only its new tokens answers as a
    whole prompt from slot 0 does."""
    sched = gemma4.scheduler()
    first = PROMPTS[0]
    answer = list(sched.generate(sched.embed(first), mode="hybrid", max_new_tokens=N, ignore_eos=True))
    turn = first + answer[:-1] + [40, 41, 42, 43, 44]  # the answer's last id is never fed: not in the cache
    start = sched.rows[0].reusable("hybrid", len(first) + len(answer) - 1)
    assert start > gemma4.text.window
    got = list(sched.generate(sched.embed(turn)[start:], mode="hybrid", max_new_tokens=N, ignore_eos=True,
                              start=start))
    assert got == gemma4.generate(turn)
    if gemma4.attention == "gqa_in_place":  # the kept prefix's rows were evicted by the answer: a snapshot's copy
        costs = sched.rows[0].cache.costs()
        assert costs["restores"] == 1 and costs["snapshots"] >= 1


def test_lookahead_drafts_keep_the_answer(gemma4, monkeypatch):
    """Prompts that repeat themselves (a prompt, its answer's start, the prompt again): drafts are proposed (2-grams
    too), rejected drafts rewind the windowed rows, and every answer is plain decoding's."""
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    sched = gemma4.scheduler(lookahead=3)
    drafted = 0
    for first in PROMPTS:
        ids = first + gemma4.generate(first)[:8] + first
        got = list(sched.generate(sched.embed(ids), mode="hybrid", max_new_tokens=N, ignore_eos=True, prompt_ids=ids))
        assert got == gemma4.generate(ids)
        drafted += sched.last.drafted_tokens
    assert drafted > 0


def _verify_with_drafts(row, prompt: list[int], want: list[int], vocab: int) -> list[int]:
    """The first N ids of `prompt`'s answer through verify calls of 1 + 3 rows at every slot: drafts are `want`'s next
    ids up to a wrong one (0, 1 or 2 accepted in turn)."""
    out = [int(np.argmax(row.prefill(row.embed(prompt), "hybrid")))]
    greedy, j = Sampler(SamplingConfig()), 0
    while len(out) < N:
        good = want[len(out): len(out) + 3]
        k = min(j % 3, len(good))
        drafts = good[:k] + ([(good[k] + 1) % vocab] if k < len(good) else [])
        out += row.verify(out[-1], drafts, greedy)
        j += 1
    return out[:N]


def test_rejected_drafts_across_evictions(gemma4):
    """Verify calls of 1 + 3 rows at every slot of the answer, their drafts generate's next ids up to a wrong one
    (0, 1 or 2 accepted): the ids are generate's. A windowed cache keeps a call's first rows alone where its eviction
    left their rows in place, and runs them again where it moved them (replays > 0)."""
    want = gemma4.generate(PROMPTS[1])
    sched = gemma4.scheduler(lookahead=3)
    row = sched.rows[0]
    assert _verify_with_drafts(row, PROMPTS[1], want, gemma4.text.vocab) == want
    assert (row.replays > 0) == (gemma4.attention == "gqa_in_place")


def test_three_conversations_batched_answer_as_alone(gemma4):
    sched = gemma4.scheduler(rows=3)
    seqs = [sched.add(Sequence(sched.embed(ids), "hybrid", N, ignore_eos=True)) for ids in PROMPTS]
    while not all(s.done for s in seqs):
        sched.step()
    for s, ids in zip(seqs, PROMPTS):
        assert s.ids[:N] == gemma4.generate(ids)


def test_per_layer_rows_ride_in_the_token_row(gemma4):
    """The host table's row is the scaled embedding and, where the checkpoint has per-layer inputs, the token's
    per-layer row beside it (times sqrt(per_layer)), as transformers computes them."""
    lm = gemma4.model.model
    ids = torch.tensor([3, 77, 299])
    with torch.no_grad():
        want = lm.embed_tokens(ids)
        if gemma4.text.per_layer:
            want = torch.cat([want, lm.embed_tokens_per_layer(ids)], dim=1)
    assert np.array_equal(gemma4.table[ids.numpy()], want.numpy())


@pytest.mark.parametrize("edit, message", [
    ({"enable_moe_block": True, "num_experts": 4}, "MoE experts"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer type chunked_attention"),
    ({"use_bidirectional_attention": "all"}, "bidirectional text decoder"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope type 'yarn'"),
])
def test_unsupported_checkpoints_are_refused_in_one_line(edit, message):
    from vlmrt.families.decoder import UnsupportedCheckpoint

    text = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "hidden_size": 64, "intermediate_size": 96, "vocab_size": 300, **edit}
    with pytest.raises(UnsupportedCheckpoint, match=message) as e:
        Gemma4TextConfig.from_hf(text)
    assert "\n" not in str(e.value)


def test_hub_config_form_reads_global_head_dim():
    """The hub's config.json (a gemma4 checkpoint: text_config with global_head_dim and num_global_key_value_heads,
    no per_layer_config) gives the full layers the shapes transformers gives them."""
    from vlmrt.families.gemma4.config import text_config

    hub = {"model_type": "gemma4", "text_config": {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64,
        "intermediate_size": 96, "vocab_size": 300, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}}
    t = Gemma4TextConfig.from_hf(text_config(hub))
    assert [(s.kv_heads, s.head_dim, s.k_eq_v) for s in t.shapes] == [(2, 16, False)] * 3 + [(1, 32, True)]


def test_decoder_refuses_an_unknown_attention_kind(gemma4):
    with pytest.raises(ValueError, match="unknown attention kind 'ring'"):
        gemma4.decoder.with_options(attention="ring", logit_rows=True, rope_positions=8)


def test_weight_only_export_finds_the_head_behind_the_softcap(gemma4, tmp_path):
    """A weight-only precision quantizes every constant-weight MatMul, the lm head behind the logit soft-capping
    (Div, Tanh, Mul) included (export/cpu/quantize.producer_matmul: on main the export stops there, "cannot find the
    lm head MatMul"), and the graph answers through the cache."""
    import onnx
    import onnxruntime as ort

    path = tmp_path / "w8a16.onnx"
    graphs.export_decoder(gemma4.decoder, attention=gemma4.attention, ar=AR, max_context=CTX, hidden=gemma4.table.shape[1],
                          io_dtype="fp32",
                          precision="w8a16", head="w8a16", path=path, dynamic_context=True, dynamic_ar=True)
    g = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name for i in g.initializer}
    assert not [n.name for n in g.node if n.op_type == "MatMul" and n.input[1] in weights]
    by_out = {o: n for n in g.node for o in n.output}
    node = by_out["logits"]
    while node.op_type in ("Div", "Tanh", "Mul", "Cast"):
        node = by_out[node.input[0]]
    assert node.op_type == "MatMulNBits"
    sched = gemma4.scheduler(session=ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    assert len(list(sched.generate(sched.embed(PROMPTS[0]), max_new_tokens=N, ignore_eos=True))) == N


def test_static_graphs_answer_as_generate(tmp_path):
    """The HTP target's form on the CPU EP: rows_static prefill (AR 4) and decode (AR 1) graphs over the whole cache
    (rows_concat, the HTP's float attention), the sliding window added to the static mask in the graph: 24 greedy ids
    equal generate in both modes on a prompt past the window (the shared checkpoint, exported twice here)."""
    import onnxruntime as ort

    from vlmrt.format.manifest import RowsStaticKind

    model, config = _checkpoint("shared", tmp_path)
    text = Gemma4TextConfig.from_hf(config)
    decoder, table = language.load(text, Tensors(model.state_dict()), "model.")
    table = table.rows(0, text.vocab)
    sessions = {}
    for ar in (AR, 1):
        path = tmp_path / f"static{ar}.onnx"
        graphs.export_decoder(decoder, attention="rows_concat", ar=ar, max_context=CTX, hidden=table.shape[1],
                              io_dtype="fp32", precision="fp32",
                              head="fp32", path=path, cpu=False)
        sessions[ar] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    dec = DecoderSpec(hidden_size=table.shape[1], vocab_size=text.vocab, prefill_ar=AR, embeds_input="inputs_embeds",
                      positions=PositionsSpec("position_ids"), logits_output="logits", embedding_file="embed.npy",
                      embedding_dtype="float32", kind=RowsStaticKind(name="rows_static", mask_input="attention_mask"))
    layers = cache_kinds.kv_layers(decoder, text, graphs.LAYOUTS["rows_concat"].out_prefix)
    sched = Scheduler(DecoderSessions(decode=sessions[1], prefill=sessions[AR]),
                      DecoderConfig(KVSpec(max_context=CTX, dtype="float32", layers=layers), dec, [1]), table)
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPTS[1]):].tolist()
    for mode in ("kv", "hybrid"):
        assert list(sched.generate(sched.embed(PROMPTS[1]), mode=mode, max_new_tokens=N, ignore_eos=True)) == want
    # the HTP target fuses every one of its RMSNorms (Gemma's (mean + eps)^-0.5 form, the weightless v_norm too) into
    # the op the HTP computes whole (export/fuse.py; none fused before: each edge then had its own 16-bit range)
    graph, fused = fuse.prepare_for_qdq(onnx.load(str(tmp_path / f"static{AR}.onnx")))
    assert fused == 46 and not [n for n in graph.graph.node if n.op_type == "ReduceMean"]  # (8 a layer, 6 a shared one, 2)
    assert fuse.fuse_rms_norm(onnx.load(str(tmp_path / f"static{AR}.onnx"))) == 0  # (the CPU graphs' chains only)


@pytest.mark.parametrize("neg", [None, -100.0])
def test_window_keeps_the_masks_hidden_value(neg):
    """The rows kinds' sliding mask hides a key out of the window with the mask's own hidden value (float32's lowest
    on the CPU, the HTP's -100): its 16-bit range in a QDQ graph stays the mask's (the lowest float there made the
    tensor's scale ~5e33, every hidden slot read back as 0: the sliding layers saw every slot)."""
    from vlmrt.runtime.decode.kv_cache import attention_mask

    text = Gemma4TextConfig.from_hf(dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, **CONFIGS["plain"]))
    decoder = language.Gemma4Decoder(text)
    low = np.finfo(np.float32).min if neg is None else neg
    for pos, ar in ((0, 4), (6, 4), (9, 1), (CTX, 1)):
        mask = attention_mask(pos, ar, CTX, neg=neg)
        got = decoder._windowed(torch.from_numpy(mask)).numpy()
        q = pos + np.arange(ar)[:, None]
        k = np.concatenate([np.arange(CTX), pos + np.arange(ar)])[None, :]
        seen = (mask == 0) & (k > q - text.window)
        assert set(np.unique(got)) <= {0.0, low if pos < CTX else -100.0}
        assert np.array_equal(got == 0, seen)


# --- the 8-bit cache (`--kv-cache int8`): every layer kind of the "shared" pattern (windowed sliding layers, a full
# layer of its own head_dim / kv heads, kv-shared layers reading both) in int8 buffers ---

@pytest.fixture(scope="session")
def gemma4_int8(tmp_path_factory):
    """(the "shared" checkpoint's decoder with the int8 cache, the same with the float cache: the gemma4 fixture's)."""
    return _exported("shared", "gqa_in_place", 8, tmp_path_factory), _exported("shared", "gqa_in_place", 0,
                                                                                tmp_path_factory)


def test_int8_cache_graph_takes_each_layers_scales(gemma4_int8):
    """Every GroupQueryAttention node stores int8 under the scales of the layer whose buffers it reads: a kv-shared
    layer's node its source's (windowed or full), the windowed nodes with sliding_window_cache; the state kinds
    allocate int8 buffers a quarter of the float ones."""
    int8, fp32 = gemma4_int8
    g = onnx.load(str(int8.path), load_external_data=False).graph
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == len(int8.layers)  # (one per layer: the shared ones too)
    by_layer = {x.key_input: i for i, x in enumerate(y for y in int8.layers if isinstance(y, AttentionLayer))}
    for node, layer in zip(nodes, int8.layers):
        attrs = {a.name: (a.i or a.s) for a in node.attribute}
        assert attrs["kv_cache_bit_width"] == 8 and attrs["k_quant_type"] == b"PER_CHANNEL"
        own = layer if isinstance(layer, AttentionLayer) else int8.layers[layer.source]
        assert node.input[3] == own.key_input and node.input[12] == f"k_scale_{by_layer[own.key_input]}"
        assert attrs.get("sliding_window_cache", 0) == (own.kind == "windowed_attention")
    cache = int8.scheduler().rows[0].cache
    assert {b.dtype for s in cache.states.values() for b in s.arrays} == {np.dtype(np.int8)}
    assert cache.nbytes * 4 == fp32.scheduler().rows[0].cache.nbytes


def test_int8_cache_follows_the_float_cache(gemma4_int8):
    """Teacher-forced after a 30-token prompt (evictions every 5 slots), 31 positions: the int8 cache's logits against
    the float cache's on the same weights. Measured on the AMD EPYC Zen 4 (AVX-512 VNNI): top-1 0.774 (24 of 31), KL
    0.00029; the same graph with every scale 4x coarser (about 6 bits): top-1 0.45, KL 0.0017. This checkpoint is
    chaotic (scale-1 attention over RMS-normed q / k of x5-spread random weights: a key's half-step error moves a score
    by ~0.3), so the bounds sit between the two: top-1 >= 0.6 (5 positions of room for near ties that other CPUs'
    float sums may flip), KL < 1e-3 (3.5x the measured)."""
    from vlmrt.eval import metrics

    int8, fp32 = gemma4_int8
    rng = np.random.default_rng(11)
    ids = [2, *rng.integers(3, int8.text.vocab, 60).tolist()]
    out = {}
    for name, ex in (("int8", int8), ("fp32", fp32)):
        row = ex.scheduler().rows[0]
        out[name] = row.score(row.embed(ids[:30]), ids[30:])
    c = metrics.compare_logits(out["fp32"], out["int8"])
    assert c["top1"] >= 0.6 and c["kl"] < 1e-3, c


def test_int8_cache_paths_answer_as_a_fresh_int8_run(gemma4_int8, monkeypatch):
    """On the int8 cache every path gives a fresh int8 run's ids (the same bytes in its buffers): a follow-up turn
    whose kept prefix was evicted by the answer (an int8 snapshot restored), verify calls with rejected drafts across
    evictions (kept rows or replays), lookahead drafts, three conversations batched."""
    int8, _ = gemma4_int8
    sched = int8.scheduler()
    fresh = {}
    for ids in PROMPTS:
        fresh[tuple(ids)] = list(sched.generate(sched.embed(ids), mode="hybrid", max_new_tokens=N, ignore_eos=True))

    # a follow-up reusing the first turn's rows (past the window: restored from an int8 copy)
    first = PROMPTS[0]
    answer = fresh[tuple(first)]
    sched.generate(sched.embed(first), mode="hybrid", max_new_tokens=N, ignore_eos=True)
    list(sched.generate(sched.embed(first), mode="hybrid", max_new_tokens=N, ignore_eos=True))
    turn = first + answer[:-1] + [40, 41, 42, 43, 44]
    start = sched.rows[0].reusable("hybrid", len(first) + len(answer) - 1)
    assert start > int8.text.window
    got = list(sched.generate(sched.embed(turn)[start:], mode="hybrid", max_new_tokens=N, ignore_eos=True, start=start))
    assert sched.rows[0].cache.costs()["restores"] == 1
    alone = int8.scheduler()
    assert got == list(alone.generate(alone.embed(turn), mode="hybrid", max_new_tokens=N, ignore_eos=True))
    # verify calls of 1 + 3 rows, 0-2 drafts accepted
    want = list(alone.generate(alone.embed(PROMPTS[1]), mode="hybrid", max_new_tokens=N, ignore_eos=True))
    row = int8.scheduler(lookahead=3).rows[0]
    assert _verify_with_drafts(row, PROMPTS[1], want, int8.text.vocab) == want and row.replays > 0
    # lookahead drafts on prompts that repeat themselves
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    ahead, drafted = int8.scheduler(lookahead=3), 0
    for p in PROMPTS:
        ids = p + fresh[tuple(p)][:8] + p
        plain = list(alone.generate(alone.embed(ids), mode="hybrid", max_new_tokens=N, ignore_eos=True))
        assert list(ahead.generate(ahead.embed(ids), mode="hybrid", max_new_tokens=N, ignore_eos=True,
                                   prompt_ids=ids)) == plain
        drafted += ahead.last.drafted_tokens
    assert drafted > 0
    # three conversations batched
    batched = int8.scheduler(rows=3)
    seqs = [batched.add(Sequence(batched.embed(ids), "hybrid", N, ignore_eos=True)) for ids in PROMPTS]
    while not all(s.done for s in seqs):
        batched.step()
    for s, ids in zip(seqs, PROMPTS):
        assert s.ids[:N] == fresh[tuple(ids)]
