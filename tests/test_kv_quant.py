"""The CPU decoder's quantized KV cache (`vlmrt export --kv-cache int8|int4`, export/cpu/kv_quant.py): ORT's
GroupQueryAttention stores K and V in int8 (or uint8 nibble pairs) buffers under scales calibrated at export, which
the manifest records per attention layer (kv.layers[].quant) and the attention state kind allocates from.

Tolerances are bounds of the quantization itself, not margins measured on one CPU: a stored value dequantizes to
within half a scale step of the float cache's (ORT's kernels on AVX2 and AVX-512 VNNI round x / scale the same way,
and the float rows differ between them by float rounding only); the logits' bound is loose against the tiny model's
logit range. Every path of the engine runs on the int8 cache with the same answers as its plain run: lookahead drafts
and their rollback, a prefix reused, rows decoding together (the scheduler's batched call), the batch worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import CASES, exported

pytest.importorskip("torch")

from vlmrt.batch.worker import Answerer  # noqa: E402
from vlmrt.eval import metrics  # noqa: E402
from vlmrt.runtime.vlm import VLM  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return exported(CASES[0], tmp_path_factory)


def _export(tiny, out, **kw):
    from vlmrt.export.pipeline import export

    m = tiny.manifest()
    return export(str(tiny.ckpt), out, progress=False, prefill_ar=m["decoder"]["prefill_ar"],
                  max_seq_len=m["kv"]["max_context"], **kw)


@pytest.fixture(scope="module")
def int8(tiny, tmp_path_factory):
    return _export(tiny, tmp_path_factory.mktemp("kv-int8") / "bundle", kv_cache="int8")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, tiny, tmp_path_factory):
    if request.param == "int8":
        return "int8", request.getfixturevalue("int8")
    return "int4", _export(tiny, tmp_path_factory.mktemp("kv-int4") / "bundle", kv_cache="int4")


def _dequantized(vlm, n: int) -> np.ndarray:
    """Rows 0..n-1 of a quantized cache as floats [layers, 2, n, kv_dim] (the manifest's scales)."""
    layers = vlm.manifest.kv.attention()
    q = layers[0].quant
    raw = vlm.row.cache.stored(n)
    if q.bits == 4:  # two values a byte, the first in the low nibble, each stored as q + 8 (q in [-8, 7])
        raw = np.stack([raw & 0x0F, raw >> 4], -1).reshape(*raw.shape[:-1], -1).astype(np.int8) - 8
    scales = np.array([[layer.quant.key_scale, layer.quant.value_scale] for layer in layers], np.float32)
    return raw.astype(np.float32) * scales[:, :, None, :]


def test_the_quantized_cache_holds_the_float_rows_within_half_a_step(quantized, tiny):
    kind, bundle = quantized
    m = json.loads((bundle / "manifest.json").read_text())
    bits = {"int8": 8, "int4": 4}[kind]
    q = m["kv"]["layers"][0]["quant"]
    assert (q["bits"], q["key"], q["value"]) == (bits, "per_channel", "per_channel")
    layer = m["kv"]["layers"][0]
    assert q["calibration_rows"] >= 256 and len(q["key_scale"]) == len(q["value_scale"]) == layer["kv_heads"] * layer["head_dim"]
    dtype = "int8" if bits == 8 else "uint8"
    past = next(t for t in m["graphs"]["decode"]["inputs"] if t["name"] == "past_key_0")
    head_dim = m["kv"]["layers"][0]["head_dim"]
    assert past["dtype"] == dtype and past["shape"][-1] == (head_dim if bits == 8 else head_dim // 2)
    a, f = VLM.load(bundle), VLM.load(tiny.bundle)
    assert a.row.cache.keys[0].dtype == np.dtype(dtype) and f.row.cache.keys[0].dtype == np.float32
    assert a.row.cache.nbytes * (4 if bits == 8 else 8) == pytest.approx(f.row.cache.nbytes, rel=0.01)
    x = np.random.default_rng(0).standard_normal((29, a.manifest.decoder.hidden_size)).astype(np.float32) * 0.5
    tokens = list(range(5, 15))
    la, lf = a.row.score(x, tokens), f.row.score(x, tokens)
    n = a.row.cache.length
    # the float rows where they were written into the float cache (the same inputs, fed the same way)
    want = f.row.cache.stored(n)
    got = _dequantized(a, n)
    layers = a.manifest.kv.attention()
    step = np.array([[layer.quant.key_scale, layer.quant.value_scale] for layer in layers], np.float32)[:, :, None, :]
    top = step * (127 if bits == 8 else 7)
    inside = np.abs(want) <= top
    assert inside.mean() > 0.99  # the calibrated range holds the rows (headroom)
    # the first layer's rows come from the same inputs: within half a step (plus float rounding); later layers carry
    # the earlier layers' quantization error on in their inputs, so they are held to the logits' bound below
    err = np.abs(got[0] - want[0])[inside[0]]
    assert (err <= (step[0] / 2 + 1e-5 * np.abs(want[0]) + 1e-6)[inside[0]]).all(), float(err.max())
    # teacher-forced against the float cache (measured on the tiny random decoder: int8 top-1 1.0, KL 0.00105; int4
    # top-1 0.5, KL 0.131, the same to 5 digits on AVX-512 VNNI and under benchmarks/avx2-only): bounds 10x / 4x the
    # measured KL
    c = metrics.compare_logits(lf, la)
    assert (c["top1"] >= 0.9 and c["kl"] < 0.01) if bits == 8 else c["kl"] < 0.5, c


def test_every_path_answers_on_the_int8_cache_as_its_plain_run(int8):
    bundle = int8
    prompts = ["Describe the weather today.", "one two three four five six seven eight nine ten eleven twelve",
               "hi", "Tell me a long story about a cat and a dog who became friends."]
    opts = dict(max_new_tokens=14, ignore_eos=True)
    plain = VLM.load(bundle)
    alone = []
    for p in prompts:
        plain.reset()
        alone.append(plain(p, **opts).token_ids)
    # lookahead drafts, verified and rolled back in the int8 buffers
    ahead = VLM.load(bundle, lookahead=3)
    for p, want in zip(prompts, alone):
        ahead.reset()
        assert ahead(p, **opts).token_ids == want, p
    # multi-turn: the second turn keeps the first's rows (prefix reuse) and answers as a fresh run of it
    plain.reset()
    turn = [{"role": "user", "content": prompts[3]}]
    first = "".join(plain.chat(turn, **opts))
    turn += [{"role": "assistant", "content": first}, {"role": "user", "content": prompts[0]}]
    second = "".join(plain.chat(turn, **opts)), plain.result.token_ids
    assert plain.result.stats.reused_prompt_tokens > 0
    plain.reset()
    assert ("".join(plain.chat(turn, **opts)), plain.result.token_ids) == second
    assert plain.result.stats.reused_prompt_tokens == 0
    # rows decoding together through the batched call, and the batch worker (vlmrt batch, the server's slots)
    w = Answerer(str(bundle), options={"max_new_tokens": 14, "ignore_eos": True}, sequences=3)
    assert w.scheduler.batched
    lines = {r["id"]: r for r in w.answers([{"id": i, "messages": [{"role": "user", "content": p}]}
                                            for i, p in enumerate(prompts)])}
    for i, want in enumerate(alone):
        assert lines[i]["token_ids"] == want, prompts[i]


def test_a_quantized_cache_decodes_on_orts_scores_kernel(quantized, tiny, monkeypatch):
    """ORT's GroupQueryAttention CPU kernel is picked when its session is built, from ORT_GQA_DISABLE_FLASH_ATTENTION
    (runtime/gqa_kernel.py): the runtime builds a quantized cache's decoder on `scores` (measured faster at every
    length, docs/performance.md), a float cache's on `flash`, and leaves the variable as it found it; a value the user
    set wins. The two kernels give the same logits to float rounding (7e-6 on attention outputs of ~6: one
    GroupQueryAttention node, int8 and fp32, batched and multi-row; measured)."""
    import onnxruntime as ort

    from vlmrt.runtime import gqa_kernel

    kind, bundle = quantized
    built, real = [], ort.InferenceSession

    def spy(path, *a, **kw):
        built.append((str(path).rsplit("/", 1)[-1], os.environ.get(gqa_kernel.ENV)))
        return real(path, *a, **kw)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    monkeypatch.delenv(gqa_kernel.ENV, raising=False)
    scores, flat = VLM.load(bundle), VLM.load(tiny.bundle)
    assert built == [("decoder.onnx", "1"), ("decoder.onnx", "0")] and gqa_kernel.ENV not in os.environ, built
    monkeypatch.setenv(gqa_kernel.ENV, "0")  # the user's choice: flash
    flash = VLM.load(bundle)
    assert built[-1] == ("decoder.onnx", "0") and os.environ[gqa_kernel.ENV] == "0"
    x = np.random.default_rng(1).standard_normal((21, scores.manifest.decoder.hidden_size)).astype(np.float32) * 0.5
    tokens = list(range(5, 13))
    np.testing.assert_allclose(scores.row.score(x, tokens), flash.row.score(x, tokens), atol=1e-4, rtol=0)
    assert flat.row.cache.keys[0].dtype == np.float32


def test_the_scores_kernel_prefills_in_blocks_of_at_most_its_rows(int8, tmp_path, monkeypatch):
    """ORT's `scores` kernel holds a call's scores, [heads, rows, max_context] float32 (SmolLM2 at 4352 slots: 20 MB
    at the default block of 128 rows): a decoder on it prefills in blocks of at most gqa_kernel.PREFILL_ROWS rows
    (64: no slower than 128, measured; docs/performance.md), whatever the bundle's block; on `flash` (the user's
    choice here; a float cache's kernel) in the bundle's block. Before, 128-row blocks on either kernel."""
    from vlmrt.runtime import gqa_kernel

    view = tmp_path / "block-128"  # the int8 bundle with the default block (its graph takes any AR up to it)
    view.mkdir()
    for f in int8.iterdir():
        if f.name != "manifest.json":
            os.link(f, view / f.name)
    m = json.loads((int8 / "manifest.json").read_text())
    m["decoder"]["prefill_ar"] = 128
    (view / "manifest.json").write_text(json.dumps(m))
    x = np.random.default_rng(2).standard_normal((150, m["decoder"]["hidden_size"])).astype(np.float32) * 0.5

    def blocks(vlm) -> list[int]:
        sizes, step = [], vlm.row.step
        vlm.row.step = lambda purpose, embeds, *a, **kw: sizes.append(len(embeds)) or step(purpose, embeds, *a, **kw)
        vlm.row.prefill(x, "hybrid")
        return sizes

    monkeypatch.delenv(gqa_kernel.ENV, raising=False)
    assert gqa_kernel.PREFILL_ROWS["scores"] == 64
    assert blocks(VLM.load(view)) == [64, 64, 22]
    monkeypatch.setenv(gqa_kernel.ENV, "0")
    assert blocks(VLM.load(view)) == [128, 22]


def test_bad_cache_options_are_one_line(tiny, tmp_path):
    from vlmrt.export.cpu import kv_quant
    from vlmrt.export.pipeline import ExportError

    with pytest.raises(ExportError, match="--kv-cache int8 is the CPU decoder's GroupQueryAttention cache"):
        _export(tiny, tmp_path / "p", kv_cache="int8", attention="portable")
    with pytest.raises(ExportError, match="unknown --kv-cache"):
        _export(tiny, tmp_path / "p", kv_cache="int2")
    assert not (tmp_path / "p").exists()
    with pytest.raises(kv_quant.KVQuantError, match="saw 40 rows"):
        kv_quant.scales([np.ones((2, 8), np.float32)], 40, 8)


@pytest.mark.parametrize("change, needle", [
    (lambda m: m["kv"]["layers"][0]["quant"].update(bits=6), "kv.layers[0]: quant.bits 6 is not 8 or 4"),
    (lambda m: m["kv"]["layers"][1]["quant"]["key_scale"].pop(), "kv.layers[1]: quant.key_scale must hold"),
    (lambda m: m["kv"]["layers"][0]["quant"].update(value="per_row"), "quant.value 'per_row' is not one of"),
    (lambda m: m["kv"]["layers"][0]["quant"].update(value="per_tensor", value_scale=[0.05]),
     "quant.key per_channel and quant.value per_tensor differ"),
    (lambda m: m["decoder"].update(kind={"name": "rows_dynamic", "mask_input": "attention_mask", "context_step": 64,
                                         "logit_rows_input": "logit_rows"}), "needs decoder kind gqa_in_place"),
])
def test_a_malformed_quantized_cache_is_refused(quantized, change, needle, tmp_path):
    import shutil

    from vlmrt.format import manifest as mf

    b = tmp_path / "b"
    shutil.copytree(quantized[1], b)
    m = json.loads((b / "manifest.json").read_text())
    change(m)
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(mf.BundleError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        mf.load(b, verify=False)


def test_the_browser_refuses_a_quantized_cache_in_one_line(quantized, tmp_path, capsys):
    from vlmrt import cli

    rc = cli.main(["web", str(quantized[1]), "--out", str(tmp_path / "site")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "--kv-cache fp32" in err[0] and "keeps a float cache" in err[0], err
    assert not (tmp_path / "site").exists()


def test_a_calibration_too_small_for_stable_scales_is_one_line(tiny, tmp_path, capsys):
    import shutil

    from conftest import image_file
    from vlmrt import cli

    cal = tmp_path / "cal"
    cal.mkdir()
    shutil.copy(image_file("chelsea.png", tmp_path), cal / "chelsea.png")
    (cal / "prompts.txt").write_text("hi\n")
    out = tmp_path / "out"
    rc = cli.main(["export", str(tiny.ckpt), str(out), "--kv-cache", "int8", "--calibration", str(cal), "--quiet",
                   "--prefill-ar", "8", "--max-seq-len", "320"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "the KV cache calibration saw" in err[0] and "256" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal"]  # nothing half-written next to OUT either


def test_lfm2_conv_layers_keep_float_rows_beside_an_int8_attention_cache(tmp_path_factory):
    """Each GroupQueryAttention node takes its own attention layer's scales though conv layers come between them."""
    from family_cases import LFM2_CASES, lfm2_exported

    ex = lfm2_exported(next(c for c in LFM2_CASES if c.name == "lfm2-conv-attn-conv-conv-gqa"), tmp_path_factory)
    m = ex.manifest()
    bundle = _export(ex, tmp_path_factory.mktemp("lfm2-int8") / "bundle", kv_cache="int8",
                     attention=ex.case.attention, context_step=ex.case.context_step)
    a, f = VLM.load(bundle), VLM.load(ex.bundle)
    kinds = [layer.kind for layer in a.manifest.kv.layers]
    assert "conv" in kinds and kinds.count("attention") == len([x for x in a.manifest.kv.attention() if x.quant])
    assert a.row.cache.keys[0].dtype == np.int8 and a.row.cache.states["conv"].rows[0].data.dtype == np.float32
    assert m["kv"]["layers"] == [{**x, "quant": None} if x["kind"] == "attention" else x
                                 for x in json.loads((bundle / "manifest.json").read_text())["kv"]["layers"]]
    x = np.random.default_rng(1).standard_normal((21, a.manifest.decoder.hidden_size)).astype(np.float32) * 0.5
    c = metrics.compare_logits(f.row.score(x, list(range(5, 15))), a.row.score(x, list(range(5, 15))))
    assert c["top1"] >= 0.9 and c["kl"] < 0.01, c


def test_each_node_takes_the_scales_of_the_buffers_it_reads():
    """quantize_cache maps a GroupQueryAttention node to the layer whose K buffer it reads, not to its position:
    Gemma 4's kv-shared layers run a node over their source's buffers, a span graph's windowed layer runs a second
    node over a Pad of them, and a layer left float keeps its node as it is (ORT 1.32 takes the quantized cache with
    each: docs/gemma4.md). On ef8b8dc the i-th node took the i-th layer's scales and one shape for all."""
    import dataclasses

    import onnx
    from onnx import TensorProto as TP, helper

    from vlmrt.export.cpu import kv_quant
    from vlmrt.format.manifest import AttentionLayer, CacheQuant, WindowedAttentionLayer

    def quant(n, s):
        return CacheQuant(8, "per_channel", "per_channel", [s] * n, [s / 2] * n, 1.25, 300)

    windowed = WindowedAttentionLayer("windowed_attention", 2, 16, "past_key_0", "past_value_0", "present_key_0",
                                      "present_value_0", quant(32, 0.1), window=4, capacity=8)
    full = AttentionLayer("attention", 1, 32, "past_key_1", "past_value_1", "present_key_1", "present_value_1",
                          quant(32, 0.2))
    f = TP.FLOAT
    ins = [helper.make_tensor_value_info(n, f, [1, h, None, d]) for n, h, d in
           [("past_key_0", 2, 16), ("past_value_0", 2, 16), ("past_key_1", 1, 32), ("past_value_1", 1, 32),
            ("past_key_2", 1, 32), ("past_value_2", 1, 32)]]
    pads = helper.make_tensor("pads", TP.INT64, [8], [0, 0, 0, 0, 0, 0, 4, 0])
    nodes = [helper.make_node("Pad", ["past_key_0", "pads"], ["padded_k"]),
             helper.make_node("Pad", ["past_value_0", "pads"], ["padded_v"])]
    reads = [("past_key_0", "past_value_0", "present_key_0", "present_value_0"),  # the windowed layer's own node
             ("padded_k", "padded_v", "span_k", "span_v"),  # a span graph's second node
             ("past_key_1", "past_value_1", "present_key_1", "present_value_1"),  # the full layer's
             ("past_key_0", "past_value_0", "shared_k", "shared_v"),  # a kv-shared layer reading the windowed one
             ("past_key_2", "past_value_2", "present_key_2", "present_value_2")]  # a layer left float
    for i, (k, v, pk, pv) in enumerate(reads):
        nodes.append(helper.make_node("GroupQueryAttention", ["q", "", "", k, v, "seqlens_k", "total"],
                                      [f"out{i}", pk, pv], domain="com.microsoft", num_heads=4, kv_num_heads=1))
    outs = [helper.make_tensor_value_info(n, f, None) for n in
            ("present_key_0", "present_value_0", "present_key_1", "present_value_1", "present_key_2", "present_value_2")]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs, [pads]))
    assert kv_quant.quantize_cache(model, [windowed, full]) == 4
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    scales = [list(n.input[12:]) for n in gqa]
    assert scales == [["k_scale_0", "v_scale_0"]] * 2 + [["k_scale_1", "v_scale_1"], ["k_scale_0", "v_scale_0"], []]
    bits = [{a.name: a.i for a in n.attribute}.get("kv_cache_bit_width") for n in gqa]
    assert bits == [8, 8, 8, 8, None]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert inits["k_scale_0"].shape == (2, 1, 16) and inits["k_scale_1"].shape == (1, 1, 32)
    assert float(inits["v_scale_1"].max()) == pytest.approx(0.1)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.output]}
    assert [types[n] for n in ("past_key_0", "present_value_1", "past_key_2")] == [TP.INT8, TP.INT8, TP.FLOAT]
    with pytest.raises(kv_quant.KVQuantError, match="no GroupQueryAttention node reads the cache of past_key_9"):
        kv_quant.quantize_cache(model, [dataclasses.replace(full, key_input="past_key_9")])


def test_a_4bit_windowed_cache_needs_head_dim_a_multiple_of_32():
    """ORT 1.32's windowed kernel refuses a 4-bit cache at head_dim 16 when run ("sliding_window_cache: head_size
    (16) must be a multiple of 32 for a 4-bit KV cache."): the manifest entry says so (the loader, and the exporter
    before writing anything: pipeline._kv_quant)."""
    from vlmrt.format.manifest import CacheQuant, WindowedAttentionLayer

    def layer(d):
        q = CacheQuant(4, "per_channel", "per_channel", [0.1] * d, [0.1] * d, 1.0, 300)
        return WindowedAttentionLayer("windowed_attention", 1, d, "a", "b", "c", "d", q, window=4, capacity=8)

    assert "multiple of 32, not 16" in layer(16).problem() and layer(64).problem() is None
