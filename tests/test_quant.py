"""Weight precisions (MatMulNBits), the HTP target (static QDQ, uint8 KV cache) and `vlmrt eval`.

Thresholds are the values measured on the tiny random SmolVLM fixture (tests/conftest.py CASES[0],
seed 0) minus a small margin for float differences across machines; random unit-gain weights with
hidden size 64 are far more sensitive to quantization than a trained model (README has the
SmolLM2-135M figures)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from cpu_isa import VNNI

from conftest import exported, CASES, graph_path, image_file, on_npu
from vlmrt import cli
from vlmrt.eval import accuracy, samples
from vlmrt.export.cpu import quantize
from vlmrt.export.pipeline import export
from vlmrt.format.manifest import KVSpec, attention_layers
from vlmrt.runtime.decode.kv_cache import KVCache
from vlmrt.runtime.vlm import VLM

pytest.importorskip("torch")

_BUNDLES: dict[str, object] = {}


def bundle(kind: str, tmp_path_factory):
    """Quantized bundles of the default fixture checkpoint, exported once per session."""
    if kind not in _BUNDLES:
        ex = exported(CASES[0], tmp_path_factory)
        c = ex.case
        out = tmp_path_factory.mktemp("q") / kind.replace(",", "_").replace("=", "-")
        kw = ({"target": "htp", "quant": "w4a16" if kind == "htp-w4" else None, "keep_qdq": True} if kind.startswith("htp")
              else {"quant": kind})
        if kind == "htp":  # with a lookahead verify graph of AR 5 (test_htp_lookahead.py)
            kw["lookahead_ar"] = 5
        _BUNDLES[kind] = export(str(ex.ckpt), out, prefill_ar=c.prefill_ar, max_seq_len=c.max_seq_len, progress=False, **kw)
    return _BUNDLES[kind]


def nbits(path) -> list[tuple[str, int]]:
    m = onnx.load(str(path), load_external_data=False)
    return [(n.name, next(a.i for a in n.attribute if a.name == "bits")) for n in m.graph.node if n.op_type == "MatMulNBits"]


def run_eval(b, ref, mode="hybrid", **kw) -> dict:
    v = VLM.load(b)
    for k, val in kw.items():
        setattr(v.row, k, val)
    return accuracy.evaluate(v, accuracy.load_reference(ref, v), samples.default_samples(), tokens=16, mode=mode)


def test_parse_precisions():
    assert quantize.parse("w4a16") == {"vision": "w8a16", "prefill": "w4a16", "decode": "w4a16"}  # vision stays 8-bit
    assert quantize.parse("w4a8") == {"vision": "w8a8", "prefill": "w4a8", "decode": "w4a8"}
    assert quantize.parse("w8a16") == {"vision": "w8a16", "prefill": "w8a16", "decode": "w8a16"}
    assert quantize.parse("vision=w4a16")["vision"] == "w4a16"  # named: as asked
    assert quantize.parse("vision=fp16,prefill=fp16,decode=w4a16,lm_head=w8a16") == {
        "vision": "fp16", "prefill": "fp16", "decode": "w4a16", "lm_head": "w8a16"}
    assert quantize.parse("decode=w8a16")["vision"] == "fp32"
    assert quantize.parse("w4a8m") == {"vision": "w8a8", "prefill": "w4a8m", "decode": "w4a8m"}
    for bad in ("int3", "decoder=w4a16", "vision=q8"):
        with pytest.raises(quantize.QuantError):
            quantize.parse(bad)


def test_rms_norm_is_one_op_in_the_graphs(default_bundle):
    """Every RMSNorm chain of the CPU decoder graphs is one SimplifiedLayerNormalization (export/fuse.py);
    their numerics are held to transformers by the greedy-id and logit tests of tests/test_smolvlm.py. The
    HTP target fuses its float graphs the same way before QDQ (counted in test_internvl's HTP test); a
    fused graph has nothing left to fuse."""
    from vlmrt.export import fuse

    model = onnx.load(str(graph_path(default_bundle.bundle, "decode")), load_external_data=False)
    ops = [x.op_type for x in model.graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 2 * 2 + 1  # 2 layers x (input, post-attention) + final
    assert not {"Pow", "Sqrt", "Reciprocal"} & set(ops)
    model, n = fuse.prepare_for_qdq(model)
    assert n == 0 and next(o.version for o in model.opset_import if o.domain == "") == fuse.QDQ_OPSET


def test_fp32_bundle_equals_float_reference(default_bundle, capsys):
    """`vlmrt eval --reference CHECKPOINT` (torch modules) on the fp32 bundle is exact: measured top-1 1.0, KL 0."""
    capsys.readouterr()
    assert cli.main(["eval", str(default_bundle.bundle), "--reference", str(default_bundle.ckpt), "--tokens", "16",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["bundle"] == str(default_bundle.bundle) and r["mode"] == "hybrid"
    assert r["first_token_match"] == 1.0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-9
    assert r["samples"] == len(samples.default_samples()) and r["positions"] > 60


def test_w8a16_bundle(tmp_path_factory, default_bundle):
    b = bundle("w8a16", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert {k: g["precision"] for k, g in m["graphs"].items()} == {"vision": "w8a16", "prefill": "w8a16", "decode": "w8a16"}
    assert m["graphs"]["decode"]["weights"] == {"block_size": 32, "symmetric": True, "lm_head": "w8a16"}
    bits = nbits(graph_path(b, "decode"))
    # 2 layers x (q/k/v fused, o, gate/up fused, down) + lm head: quantize.fuse_shared_input_matmuls
    assert len(bits) == 2 * 4 + 1 and {x for _, x in bits} == {8}
    assert m["decoder"]["embedding_dtype"] == "int8" and np.load(b / "embed.npy").dtype == np.int8
    fp32 = sum(e["bytes"] for e in default_bundle.manifest()["files"].values())
    assert sum(e["bytes"] for e in m["files"].values()) < 0.6 * fp32  # measured 0.54 (tiny graphs carry overhead)
    r = run_eval(b, default_bundle.ckpt)  # measured: first-token 1.0, top-1 0.902, KL 0.0021
    assert r["first_token_match"] >= 0.85 and r["top1_agreement"] >= 0.88 and r["mean_kl"] < 0.004


def mlas_fake_quant(w: np.ndarray, bits: int) -> np.ndarray:
    """A torch Linear weight [out, in] through MatMulNBits' symmetric round-to-nearest quantization, dequantized:
    blocks of 32 along `in` for each output row; v = the block's value of largest magnitude, scale = -v / 2^(bits-1),
    q = clamp(round(x / scale) + 2^(bits-1), 0, 2^bits - 1) rounding half away from zero (MLAS's rule)."""
    w = np.asarray(w, np.float32)
    rows, k = w.shape
    b = np.pad(w, ((0, 0), (0, (-k) % 32))).reshape(rows, -1, 32)
    v = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    mid = np.float32(2 ** (bits - 1))
    scale = (-v / mid).astype(np.float32)
    recip = (np.float32(1) / np.where(scale != 0, scale, np.float32(1))) * (scale != 0)
    x = b * recip.astype(np.float32) + mid
    q = np.clip(np.sign(x) * np.floor(np.abs(x) + np.float32(0.5)), 0, 2 * mid - 1)
    return ((q - mid) * scale).reshape(rows, -1)[:, :k]


def fake_quantized_hf_model(ex, manifest: dict):
    """transformers' model on the fixture's weights quantized in numpy as the bundle's precisions say: each graph's
    Linear weights (and the vision patch embedding, a MatMul in the graph) by mlas_fake_quant, the host embedding
    table per-row symmetric int8."""
    import copy

    import torch

    bits = {p: quantize.WEIGHT_ONLY_BITS[p] for p in quantize.WEIGHT_ONLY_BITS}
    g = manifest["graphs"]
    assert g["prefill"]["precision"] == g["decode"]["precision"]
    vision, body, head = bits[g["vision"]["precision"]], bits[g["decode"]["precision"]], bits[g["decode"]["weights"]["lm_head"]]
    model = copy.deepcopy(ex.hf()[0])
    with torch.no_grad():
        for name, mod in model.named_modules():
            in_vision = ".vision_model." in f".{name}" or ".connector." in f".{name}"
            if isinstance(mod, torch.nn.Linear):
                n = head if name == "lm_head" else vision if in_vision else body
                mod.weight.copy_(torch.from_numpy(mlas_fake_quant(mod.weight.numpy(), n)))
            elif isinstance(mod, torch.nn.Conv2d):  # the patch embedding: a MatMul over (c, py, px) rows in the graph
                assert in_vision
                w = mod.weight.numpy()
                mod.weight.copy_(torch.from_numpy(mlas_fake_quant(w.reshape(len(w), -1), vision).reshape(w.shape)))
        emb = model.get_input_embeddings().weight
        table = emb.numpy().astype(np.float64)
        amax = np.abs(table).max(1, keepdims=True)
        scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
        emb.copy_(torch.from_numpy((np.clip(np.rint(table / scale), -127, 127) * scale).astype(np.float32)))
    return model


@pytest.mark.parametrize("kind", ["w8a16", "w4a16"])
def test_weight_only_bundle_equals_transformers_on_fake_quantized_weights(kind, tmp_path_factory, default_bundle):
    """An independent reference for the weight-only precisions: transformers on the fixture's weights quantized
    in numpy (mlas_fake_quant) gives the bundle's logits to float32 rounding — at the last prompt token in both
    modes, and teacher-forced along transformers' 12 greedy ids (measured max |diff| ~1e-5 of logits ~3)."""
    import torch

    from vlmrt.runtime.media import image as img_ops

    b = bundle(kind, tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    model = fake_quantized_hf_model(default_bundle, m)
    v = VLM.load(b)
    path = image_file("chelsea.png", None)
    tiles = img_ops.preprocess(img_ops.load_image(path), v.manifest.image)
    p = v.prompt("What is in the image?", [path])
    ids, embeds = p.ids, v.embed_prompt(p)
    with torch.no_grad():
        seq = torch.tensor([ids])
        pixels = torch.from_numpy(tiles.pixels[None])
        for _ in range(12):
            nxt = model(input_ids=seq, pixel_values=pixels).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], 1)
        ref = model(input_ids=seq, pixel_values=pixels).logits[0, len(ids) - 1:].numpy()
    want = seq[0, len(ids):].tolist()
    for mode in ("kv", "hybrid"):
        got = v.row.score(embeds, want, mode)
        assert len(got) == len(want) == 12
        err = np.abs(got - ref[: len(got)]).max()
        assert err < 1e-3 * np.abs(ref).max(), (mode, err)
        assert (got.argmax(-1) == ref[: len(got)].argmax(-1)).all()


def test_mixed_precisions_per_graph(tmp_path_factory, default_bundle):
    b = bundle("vision=fp16,prefill=fp16,decode=w4a16,lm_head=w8a16", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert {k: g["precision"] for k, g in m["graphs"].items()} == {"vision": "fp16", "prefill": "fp16", "decode": "w4a16"}
    assert m["graphs"]["prefill"]["weights"]["lm_head"] == "w8a16"
    dec, pre = nbits(graph_path(b, "decode")), nbits(graph_path(b, "prefill"))
    assert sorted(x for _, x in dec) == [4] * 8 + [8]  # body int4 (2 layers x 4 after fusing q/k/v, gate/up), lm head int8
    assert [x for _, x in pre] == [8]  # fp16 body, int8 lm head
    vis = onnx.load(str(b / "vision.onnx"), load_external_data=False)
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in vis.graph.initializer)
    assert vis.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # fp32 I/O kept
    r = run_eval(b, default_bundle.ckpt)  # measured: first-token 1.0, top-1 0.616 (int4 on hidden-64 random weights)
    assert r["first_token_match"] >= 0.85 and r["top1_agreement"] >= 0.57


def test_q4_k_m_style_mix(tmp_path_factory, default_bundle):
    """w4a8m: int4 (int8 compute) except every layer's v_proj and down_proj at int8, as llama.cpp's Q4_K_M;
    the manifest says which. Closer to the reference than all-int4 on the same weights."""
    b = bundle("w4a8m", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert m["graphs"]["decode"]["weights"]["8bit"] == {"precision": "w8a8", "matmuls": [".self_attn.v_proj.", ".mlp.down_proj."]}
    for g in ("prefill", "decode"):
        model = onnx.load(str(graph_path(b, g)), load_external_data=False)
        wide = sorted(n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"
                      and next(a.i for a in n.attribute if a.name == "bits") == 8)
        assert [w.split(".")[-3:-1] for w in wide] == [["mlp", "down_proj"], ["self_attn", "v_proj"]] * 2
        # 2 layers x (int4: q/k fused, o, gate/up fused; int8: v, down) + int4 head
        assert sorted(x for _, x in nbits(graph_path(b, g))) == [4] * 7 + [8] * 4
    mixed, plain = run_eval(b, default_bundle.ckpt), run_eval(bundle("w4a8", tmp_path_factory), default_bundle.ckpt)
    # measured side by side (Intel Xeon with VNNI, session 11): mix top-1 0.473, KL 0.100; all-int4 top-1 0.473, KL 0.113;
    # (AMD EPYC without AVX-512, session 12: mix 0.366, KL 0.142; all-int4 0.366, KL 0.156: ORT's int8 kernels differ
    # by CPU, so the floor is the all-int4 bundle measured in the same run, not one CPU's number).
    # Top-1 on this hidden-64 random model is chaotic; the KL is what the two 8-bit projections move.
    assert mixed["mean_kl"] < 0.95 * plain["mean_kl"] and mixed["top1_agreement"] >= plain["top1_agreement"]


@pytest.mark.parametrize("bits, level", [(4, 4), (4, None), (8, 4)])
def test_fused_projections_compute_what_separate_ones_do(bits, level):
    """q/k/v (and gate/up) read the same input: fused into one MatMul + Split before weight-only quantization,
    the outputs are bit-identical to three quantized MatMuls (quantization runs per output column)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    ws = {"wq": rng.standard_normal((64, 48)), "wk": rng.standard_normal((64, 16)), "wv": rng.standard_normal((64, 16)),
          "wo": rng.standard_normal((48, 64))}
    nodes = [helper.make_node("MatMul", ["x", w], [w.replace("w", "y")], name=f"mm_{w}") for w in ("wq", "wk", "wv")]
    nodes.append(helper.make_node("MatMul", ["yq", "wo"], ["out"], name="mm_wo"))  # another input: not fused
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "yk", "yv")],
        [numpy_helper.from_array(w.astype(np.float32), k) for k, w in ws.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert quantize.fuse_shared_input_matmuls(fused, keep_apart=set()) == 1
    x = rng.standard_normal((3, 64)).astype(np.float32)
    outs = []
    for m in (model, fused):
        q = quantize.weight_only(m, bits, accuracy_level=level)
        outs.append(ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x}))
    assert [n.op_type for n in q.graph.node] == ["MatMulNBits", "Split", "MatMulNBits"]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_htp_bundle_on_cpu_ep(tmp_path_factory, default_bundle):
    b = bundle("htp", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert m["target"]["name"] == "htp" and m["kv"]["dtype"] == "uint8"
    assert m["decoder"]["kind"]["name"] == "rows_static" and m["decoder"]["kind"]["mask_value"] == -100.0
    for g in ("prefill", "decode"):
        enc = m["kv"]["encodings"][g]
        assert len(enc["key"]) == len(enc["value"]) == 2 and all(0 < s and 0 <= z <= 255 for s, z in enc["key"])
        ins = {t["name"]: t for t in m["graphs"][g]["inputs"]}
        outs = {t["name"]: t for t in m["graphs"][g]["outputs"]}
        assert ins["past_key_0"]["dtype"] == outs["new_value_1"]["dtype"] == "uint8"
        assert ins["inputs_embeds"]["dtype"] == "float32"
        assert all(len(t["shape"]) == 2 for t in m["graphs"][g]["inputs"] if t["name"] != "position_ids")
    ops = {n.op_type for n in onnx.load(str(graph_path(b, "decode")), load_external_data=False).graph.node}
    assert "QuantizeLinear" in ops and "MatMulNBits" not in ops
    want = VLM.load(default_bundle.bundle)("What is in the image?", image_file("chelsea.png", None), max_new_tokens=2,
                                           ignore_eos=True).token_ids
    for mode in ("kv", "hybrid"):
        got = VLM.load(b)("What is in the image?", image_file("chelsea.png", None), mode=mode, max_new_tokens=2,
                          ignore_eos=True).token_ids
        assert got == want  # measured: the first 2 greedy tokens agree with fp32 (this random model is chaotic)
    r = run_eval(b, default_bundle.ckpt)  # measured: first-token 1.0, top-1 0.884, KL 0.0045 (0.0061 before RMSNorm fusion)
    assert r["first_token_match"] >= 0.85 and r["top1_agreement"] >= 0.84 and r["mean_kl"] < 0.009
    r = run_eval(b, default_bundle.ckpt, mode="kv")  # measured: first-token 0.857, top-1 0.839, KL 0.0085 (0.011 before)
    assert r["first_token_match"] >= 0.8 and r["top1_agreement"] >= 0.8 and r["mean_kl"] < 0.017


def test_htp_4bit_weights(tmp_path_factory, default_bundle):
    """--target htp --quant w4a16: the decoder graphs' linear weights int4 block-wise (32 inputs per scale,
    symmetric; export/htp/int4_blocks.py), packed two per byte in decoder.data; the vision graph and the lm head stay
    at 8 bits. Runs on the CPU EP and as QNN context binaries on the simulator (same greedy ids in hybrid mode)."""
    b = bundle("htp-w4", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert {k: g["precision"] for k, g in m["graphs"].items()} == {"vision": "qdq-a16w8", "prefill": "qdq-a16w4",
                                                                    "decode": "qdq-a16w4"}
    g = onnx.load(str(graph_path(b, "decode")), load_external_data=False)
    blocked = [n for n in g.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 32 for a in n.attribute)]
    # 2 layers x (q, k, v, o, gate, up, down), each a Gemm; the untied lm head stays uint8 per channel
    assert len(blocked) == m["graphs"]["decode"]["weights"]["blockwise_int4"] == 14
    assert m["graphs"]["decode"]["weights"]["lm_head"] == "w8a16"
    inits = {i.name: i for i in g.graph.initializer}
    assert all(inits[n.input[0]].data_type == onnx.TensorProto.INT4 for n in blocked)
    head = next(n for n in g.graph.node if n.op_type == "DequantizeLinear" and "lm_head" in n.input[0])
    assert inits[head.input[0]].data_type == onnx.TensorProto.UINT8
    w8 = json.loads((bundle("htp", tmp_path_factory) / "manifest.json").read_text())
    assert m["files"]["decoder.data"]["bytes"] < 0.75 * w8["files"]["decoder.data"]["bytes"]
    # hidden-64 random weights are far more sensitive than a trained model; measured first-token 0.43, top-1 0.339,
    # KL 0.148 with an int4 lm head, 0.348 / 0.143 with the 8-bit one (per-channel int4 before: first-token 0.14,
    # top-1 0.205, KL 0.246)
    r = run_eval(b, default_bundle.ckpt)
    assert r["top1_agreement"] >= 0.3 and r["mean_kl"] < 0.19
    cpu, npu = VLM.load(b), VLM.load(b, device="htp")
    on_npu(npu)
    want = cpu("Describe a red square.", None, max_new_tokens=4, ignore_eos=True).token_ids
    assert npu("Describe a red square.", None, max_new_tokens=4, ignore_eos=True).token_ids == want


def test_htp_simulator_runs_every_graph_on_the_npu(tmp_path_factory, capsys):
    """--device htp: QNN EP HTP backend (the x86-64 simulator here) with CPU fallback disabled. Graphs that
    did not fit the HTP would fail to load. Outputs match the CPU EP's QDQ simulation (measured: logits
    within 0.21 of magnitude ~3, KV rows within 3 uint8 steps, same argmax)."""
    from vlmrt.runtime.media import image as img_ops

    b = bundle("htp", tmp_path_factory)
    cpu, npu = VLM.load(b, device="cpu"), VLM.load(b, device="htp")
    tiles = img_ops.preprocess(img_ops.load_image(image_file("chelsea.png", None)), cpu.manifest.image)
    e_cpu, e_npu = cpu.encode_image(tiles.pixels[:2]), npu.encode_image(tiles.pixels[:2])
    assert np.abs(e_cpu - e_npu).max() < 0.15 * np.abs(e_cpu).max()  # measured 0.076 of 3.2
    ids = cpu.prompt("Describe a red square.").ids
    for mode in ("kv", "hybrid"):
        a, h = cpu.row.prefill(cpu.scheduler.embed(ids), mode), npu.row.prefill(npu.scheduler.embed(ids), mode)
        assert a.argmax() == h.argmax() and np.abs(a - h).max() < 0.3
        for i in range(2):
            diff = np.abs(cpu.row.cache.keys[i][: len(ids)].astype(int) - npu.row.cache.keys[i][: len(ids)].astype(int))
            assert diff.max() <= 6
    on_npu(npu)
    # `vlmrt run --device htp`: the same greedy ids as the CPU EP's simulation of the same QDQ bundle
    want = cpu("What is in the image?", image_file("chelsea.png", None), max_new_tokens=3, ignore_eos=True).token_ids
    capsys.readouterr()
    assert cli.main(["run", str(b), "--device", "htp", "--image", str(image_file("chelsea.png", None)), "--prompt",
                     "What is in the image?", "--max-new-tokens", "3", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == want


def test_htp_device_refuses_a_cpu_bundle(default_bundle, capsys):
    rc = cli.main(["run", str(default_bundle.bundle), "--prompt", "hi", "--device", "htp"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("vlmrt: error:") and "--target htp" in err[-1]


def kv_spec(layers=2, dim=8, ctx=16):
    return KVSpec(max_context=ctx, dtype="uint8", layers=attention_layers(layers, 1, dim))


def encode(x, s, z):
    return np.clip(np.rint(x / s) + z, 0, 255).astype(np.uint8)


def test_requantize_rounds_and_clamps():
    """Prefill rows in encoding A, re-expressed for decode's encoding B, equal the formula
    q_B = clip(rint((q_A - z_A) * s_A / s_B) + z_B, 0, 255) evaluated in float64, byte for byte (rounding
    to nearest, ties to even; clamped at both ends) — while reading A's bytes as B (a plain cast, as
    ExecuTorch's runner does) is far off."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1.5, (10, 8)).astype(np.float32)
    a = {"key": [[0.02, 128], [0.03, 100]], "value": [[0.025, 120], [0.02, 128]]}
    # layer 1 key: identical; value 0: ratio 0.625 (no ties), value 1: ratio 2 (both ends clamp), key 0: ratio 4/3
    b = {"key": [[0.015, 140], [0.03, 100]], "value": [[0.04, 90], [0.01, 128]]}
    c = KVCache(kv_spec())
    for kind, bufs in (("key", c.keys), ("value", c.values)):
        for i, buf in enumerate(bufs):
            buf[:10] = encode(x, *a[kind][i])
    c.length = 10
    cast = [k.copy() for k in c.keys] + [v.copy() for v in c.values]
    rounded = clamped_lo = clamped_hi = 0
    c.requantize(a, b)
    for kind, bufs in (("key", c.keys), ("value", c.values)):
        for i, buf in enumerate(bufs):
            (s_a, z_a), (s_b, z_b) = a[kind][i], b[kind][i]
            raw = (encode(x, s_a, z_a).astype(np.float64) - z_a) * s_a / s_b + z_b
            want = np.clip(np.rint(raw), 0, 255).astype(np.uint8)
            np.testing.assert_array_equal(buf[:10], want)
            assert (buf[10:] == z_b).all()  # slots beyond the prompt: B's zero (KVCache.clear_unused)
            frac = raw - np.floor(raw)
            rounded += int(((frac > 0.5) & (raw < 255)).sum())  # where floor (truncation) would differ
            clamped_lo, clamped_hi = clamped_lo + int((raw < -0.5).sum()), clamped_hi + int((raw > 255.5).sum())
    assert rounded > 20 and clamped_lo > 0 and clamped_hi > 0  # the data exercise rounding and both clamps
    err_requant = np.abs((c.values[0][:10].astype(np.float32) - 90) * 0.04 - x).mean()
    err_cast = np.abs((cast[2][:10].astype(np.float32) - 90) * 0.04 - x).mean()
    assert err_requant < 0.03 < 0.5 < err_cast
    assert (c.keys[1][:10] == cast[1][:10]).all()  # identical encodings: untouched


def test_unused_slots_clean_after_any_history():
    """KVCache.clear_unused writes only what changed since the last clear (the "clean from" mark, and the whole tail
    of a buffer whose zero point changes), yet after every clear each slot from the length on holds the encoding's
    zero point and the rows below it are untouched, as the full memset of the unused slots gave. Random histories of
    every path that leaves rows past the kept length: a longer call then a shorter one (reset), a prefix reuse
    (rewind, to any n), hybrid's requantization to decode's zero points then prefill's again at the next prefill, a
    verify step keeping only its accepted rows (write of n_valid < AR), a batch slot serving a new request (reset)."""
    rng = np.random.default_rng(0)
    pre = {"key": [[0.02, 128], [0.03, 100]], "value": [[0.025, 120], [0.02, 128]]}
    dec = {"key": [[0.015, 140], [0.03, 100]], "value": [[0.04, 90], [0.02, 128]]}  # zp: 2 buffers differ, 2 equal
    c = KVCache(kv_spec(ctx=40))

    def check(enc):
        kept = c.stored().copy()
        for kind, bufs in (("key", c.keys), ("value", c.values)):
            for i, buf in enumerate(bufs):
                assert (buf[c.length:] == enc[kind][i][1]).all(), (kind, i, c.length, np.unique(buf[c.length:]))
        return kept

    dirty = written = 0  # clears that found rows past the length (the histories do exercise the mark); their end
    for _ in range(400):
        written = max(written, c.length)
        if rng.random() < 0.5:
            c.reset()
        else:
            c.rewind(int(rng.integers(0, c.length + 1)))
        dirty, written = dirty + (c.length < written), c.length
        enc = pre if rng.random() < 0.6 else dec
        before = c.stored().copy()
        c.clear_unused(enc)
        np.testing.assert_array_equal(check(enc), before)
        for _ in range(int(rng.integers(0, 4))):
            ar = int(rng.integers(1, 7))
            n = int(rng.integers(1, ar + 1))
            if c.length + n > 40:
                break
            c.store([rng.integers(0, 256, (2, 2, ar, 8), dtype=np.uint8)], n, np.zeros((1, ar), np.int64))
            if enc is pre and rng.random() < 0.5:
                c.requantize(pre, dec)
                enc = dec
                check(dec)
    assert dirty > 100

def test_kv_edges_take_the_cache_encoding_even_when_calibration_saw_an_empty_cache():
    """A prefill graph calibrated only on prompts shorter than its AR reads an all-zero cache in every
    calibration call: ORT gives the cache tensor (after its Reshape) a zero range. The cut KV edges
    must carry the encoding computed from the rows the graphs write (htp.kv_ranges), on the input
    and on the output, so that rows written and read back round-trip (found on easy-VQA: every
    prefill row clipped to zero, HTP exact match 0.46 instead of fp32's 0.98)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from vlmrt.export.htp import bundle as htp

    def init(name, v):
        return numpy_helper.from_array(np.array(v), name)

    deg = [init("v_s", np.float32(1e-10)), init("v_zp", np.uint8(0)),  # the degenerate calibration
           init("n_s", np.float32(0.2)), init("n_zp", np.uint8(3)), init("shape", np.array([4, 2], np.int64))]
    nodes = [
        helper.make_node("Reshape", ["past", "shape"], ["view"]),
        helper.make_node("QuantizeLinear", ["view", "v_s", "v_zp"], ["vq"]),
        helper.make_node("DequantizeLinear", ["vq", "v_s", "v_zp"], ["vdq"]),
        helper.make_node("QuantizeLinear", ["x", "n_s", "n_zp"], ["nq"]),
        helper.make_node("DequantizeLinear", ["nq", "n_s", "n_zp"], ["new"]),
        helper.make_node("Concat", ["vdq", "x"], ["cat"], axis=0),
    ]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "kv", [helper.make_tensor_value_info("past", f, [4, 2]), helper.make_tensor_value_info("x", f, [1, 2])],
                          [helper.make_tensor_value_info("cat", f, [5, 2]), helper.make_tensor_value_info("new", f, [1, 2])], deg)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    got = htp._cut_kv_edges(model, ["past"], {"new": "past"}, {"past": (0.5, 7)})
    assert got == {"past": (0.5, 7)}
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = np.array([[7, 9], [11, 0], [255, 8], [7, 7]], np.uint8)
    x = np.array([[1.0, -2.0]], np.float32)
    cat, new = s.run(["cat", "new"], {"past": past, "x": x})
    np.testing.assert_array_equal(cat[:4], (past.astype(np.float32) - 7) * 0.5)  # the cache read back as written
    assert new.dtype == np.uint8 and (new == encode(x, 0.5, 7)).all()  # rows written in the cache's encoding


def image_embeds(b, image) -> np.ndarray:
    """The vision graph's rows for every tile of image: [tiles * tokens, hidden]."""
    from vlmrt.runtime.media import image as img_ops

    v = VLM.load(b)
    return v.encode_image(img_ops.preprocess(img_ops.load_image(image), v.manifest.image).pixels)


def test_vision_w8a8_is_the_int8_gemm(tmp_path_factory, default_bundle):
    """The vision graph's w8a8 (what the plain int8-compute --quant w4a8 / w4a8m / w4a8o give it): int8 MatMulInteger through ORT's dynamic
    quantization (quantize.int8_matmuls), not MatMulNBits; the image's embeddings close to fp32's, and the answers
    teacher-forced on the fp32 bundle's (the decoder is fp32 in both: only the vision graph differs). Measured on this
    random fixture (hidden 64; MatMulNBits w8a8 measured 0.99966 / 0.9986, top-1 0.958, KL 0.0026), less a margin for
    other CPUs' int8 kernels (AVX2 without VNNI sums u8 x s8 pairs in 16 bits)."""
    b = bundle("vision=w8a8", tmp_path_factory)
    m = json.loads((b / "manifest.json").read_text())
    assert m["graphs"]["vision"]["precision"] == "w8a8"
    assert m["graphs"]["vision"]["weights"]["per_channel"] is True
    vis = onnx.load(str(b / "vision.onnx"), load_external_data=False)
    ops = [n.op_type for n in vis.graph.node]
    inits = {i.name for i in vis.graph.initializer}
    assert "MatMulNBits" not in ops and ops.count("DynamicQuantizeLinear") >= 1
    assert not [n for n in vis.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]  # all int8
    photo = image_file("chelsea.png", None)
    got, ref = image_embeds(b, photo).astype(np.float64), image_embeds(default_bundle.bundle, photo).astype(np.float64)
    cos = (got * ref).sum() / (np.linalg.norm(got) * np.linalg.norm(ref))
    rows = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    # measured 0.99940, worst row 0.99797; without VNNI (AMD EPYC, AVX2, session 12) 0.964, worst row 0.861
    floor, worst = (0.998, 0.99) if VNNI else (0.95, 0.83)
    assert cos >= floor and rows.min() >= worst
    v = VLM.load(b)
    with_images = [s for s in samples.default_samples() if s[0] is not None]
    r = accuracy.evaluate(v, accuracy.load_reference(default_bundle.bundle, v), with_images, tokens=16)
    if VNNI:
        assert r["first_token_match"] == 1.0 and r["top1_agreement"] >= 0.9 and r["mean_kl"] < 0.008  # 1.0, 0.9375, 0.0044
    else:  # KNOWN PROBLEM (session 12, AMD EPYC with AVX2 only): ORT's 16-bit-pair int8 sums cost the w8a8 vision
        # graph its teacher-forced top-1 (measured 0.375, first token 1.0): docs/precisions.md; not yet solved
        assert r["first_token_match"] == 1.0


def test_calibration_recorder_keeps_its_byte_budget():
    """export/htp_calibrate.Recorder: the calls that start a sequence are all kept; the reservoir of the others stops
    at its limit (64 of the 108 others) or at its byte budget (a 1B decoder's recorded caches would otherwise be ~2 GB),
    lowering its limit; RowsRecorder's (which reads the state rows by output name)
    KV ranges are the min / max over every call's rows (not only the kept ones)."""
    from vlmrt.export.htp.calibrate import Recorder, RowsRecorder, kv_ranges
    from vlmrt.format import manifest as mf

    class Echo:  # a one-layer graph: outputs logits, the new key row, the new value row
        def run(self, names, feeds):
            return [np.zeros(2, np.float32), feeds["k"][:1] + 1, -feeds["v"][:1]]

    def mask_at(slot: int, ctx: int) -> np.ndarray:  # a rows step's mask [1, ctx + 1]: slots < slot visible
        m = np.full((1, ctx + 1), -1e9, np.float32)
        m[0, :slot] = 0
        m[0, ctx] = 0
        return m

    kept = []
    layer = mf.AttentionLayer("attention", 1, 8, "k", "v", "k_row", "v_row")  # the rows' outputs read by name
    for cls, extra in ((Recorder, {"budget": 1 << 30}), (RowsRecorder, {"budget": 10_000, "layers": [layer]})):
        rec = cls(Echo(), {"k", "v"}, 64, "attention_mask", **extra)  # the slot is read from the mask
        for seq in range(3):
            for pos in range(40):  # caches [64, 8] float32, their first pos rows used: 32 bytes a row each
                past = np.full((64, 8), pos, np.float32)
                rec.run(["logits", "k_row", "v_row"], {"k": past, "v": past, "attention_mask": mask_at(pos, 64)})
        assert len(rec.first) == 12 and rec.calls == 120 and rec.bytes <= extra["budget"]
        kept.append(len(rec.sampled))
    assert kept[0] == 64 and 4 <= kept[1] < 64 and rec.limit < 64
    small = Recorder(Echo(), {"k", "v"}, 8, "attention_mask")
    for pos in range(4, 2004):  # a full reservoir stays at its limit however many calls follow
        small.run(None, {"k": np.zeros((1, 1), np.float32), "v": np.zeros((1, 1), np.float32),
                         "attention_mask": mask_at(pos, pos)})
        assert len(small.sampled) <= 8
    assert len(small.sampled) == 8
    assert sum(v.nbytes for f in rec.sampled for v, _ in f.values()) == rec.bytes
    assert kv_ranges(rec) == {"key": [(1.0, 40.0)], "value": [(-39.0, 0.0)]}


def test_htp_graphs_reach_the_quantizer_at_opset_21(tmp_path, monkeypatch):
    """ORT's QDQ quantizer converts a graph under opset 21 with onnx's version converter (16-bit activations need
    21): a serialized copy under protobuf's 2 GB limit and three more copies of the weights in memory, past this
    machine's 24 GB at InternVL3.5-1B's decoder. htp.at_opset21 raises an opset-20 graph in place, so the converter is
    never called; a graph with GroupNormalization (whose meaning changed in 21) is left as it is."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import CalibrationDataReader

    from vlmrt.export.htp import bundle as htp

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    htp.at_opset21(model)
    assert model.opset_import[0].version == 21
    onnx.save(model, str(tmp_path / "f.onnx"))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.ones((2, 8), np.float32)}, {"x": -np.ones((2, 8), np.float32)}])

        def get_next(self):
            return next(self.it, None)

    def refuse(*a, **k):
        raise AssertionError("onnx.version_converter called")

    monkeypatch.setattr(onnx.version_converter, "convert_version", refuse)
    htp.quantize_graph(tmp_path / "f.onnx", tmp_path / "q.onnx", Reader())
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node]
    assert "MatMul" in ops and "QuantizeLinear" in ops and "DequantizeLinear" in ops
    gn = helper.make_model(helper.make_graph([helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)],
                                             "g", [], []), opset_imports=[helper.make_opsetid("", 20)])
    htp.at_opset21(gn)
    assert gn.opset_import[0].version == 20


def test_vision_w8a8_from_the_file_is_the_in_memory_quantization(tmp_path):
    """quantize.quantize_vision's w8a8 reads the traced graph from its files, transposes the Gemm weights one at a
    time into a data file and lets ORT's quantizer read the graph from disk (export memory: the 2B tower's stage
    peaked at 10.8 GB with the float weights in this process beside the quantizer's copies); the graph it gives is
    the one the whole model in memory gave (gemm_to_matmul, then int8_matmuls on the ModelProto): same nodes, same
    initializers bit for bit. Guards the bundles' vision graphs against the bounded path."""
    import torch
    from onnx import numpy_helper

    from vlmrt.export import graphs

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 32, bias=False),
                                 torch.nn.LayerNorm(32), torch.nn.Linear(32, 40)).eval()
    path = tmp_path / "vision.onnx"
    graphs.trace_vision(module, {"patches": torch.randn(20, 48)}, ["image_embeds"], "fp32", "w8a8", path)
    with graphs._quiet():
        ref = quantize.int8_matmuls(quantize.gemm_to_matmul(onnx.load(str(path))))
        got = quantize.quantize_vision(path, "w8a8")
    assert quantize.kn_data(path).exists()  # (finish_vision deletes it)
    assert [(n.op_type, list(n.input), list(n.output)) for n in got.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in ref.graph.node]
    assert sum(n.op_type == "MatMulInteger" for n in got.graph.node) == 3
    assert [i.name for i in got.graph.initializer] == [i.name for i in ref.graph.initializer]
    for a, b in zip(got.graph.initializer, ref.graph.initializer):
        assert a.data_type == b.data_type and np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b)), a.name
