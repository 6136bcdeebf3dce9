"""The CPU decoder's attention as ORT's GroupQueryAttention over an in_place KV cache (the default of the one-graph
CPU export, `--attention gqa`) against the portable graph of the same checkpoint (`--attention portable`, the
graphs' own attention ops and host-written rows): both families (SmolVLM's Llama decoder; InternVL3.5's Qwen3, whose
q/k norms come before the op's RoPE), the same greedy ids in both modes, text and image prompts, logits within float
rounding, a lookahead run identical to plain, and the graph several times smaller per layer. The transformers
oracles of test_smolvlm.py / test_internvl.py run on the gqa bundles (the session's default exports)."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from conftest import image_file  # noqa: E402
from vlmrt.runtime.vlm import VLM  # noqa: E402

PROMPTS = [("Describe the picture.", "chelsea.png"), ("Repeat: one two three, one two three, one two", None)]


def _portable(ex, tmp_path_factory, **kw):
    from vlmrt.export.pipeline import export

    m = ex.manifest()
    out = tmp_path_factory.mktemp("portable") / "bundle"
    return export(str(ex.ckpt), out, progress=False, attention="portable", prefill_ar=m["decoder"]["prefill_ar"],
                  max_seq_len=m["kv"]["max_context"], **kw)


def _nodes(bundle) -> dict[str, int]:
    g = onnx.load(str(bundle / "decoder.onnx"), load_external_data=False).graph
    out = {}
    for n in g.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def check_same_answers(gqa_bundle, portable_bundle, layers, tokens=16):
    m = json.loads((gqa_bundle / "manifest.json").read_text())
    assert m["decoder"]["kind"]["name"] == "gqa_in_place" and m["decoder"]["kind"]["seqlens_input"] == "seqlens_k"
    assert "context_step" not in m["decoder"]["kind"]  # (the in_place graph reads whole buffers)
    mp = json.loads((portable_bundle / "manifest.json").read_text())
    assert mp["decoder"]["kind"]["name"] == "rows_dynamic" and mp["decoder"]["kind"]["context_step"] > 0
    fused, plain = _nodes(gqa_bundle), _nodes(portable_bundle)
    assert fused["GroupQueryAttention"] == layers and "GroupQueryAttention" not in plain
    assert sum(plain.values()) >= 2 * sum(fused.values()), (fused, plain)  # tiny graphs; the real decoder: 3.3x
    a, b = VLM.load(gqa_bundle), VLM.load(portable_bundle)
    for prompt, image in PROMPTS:
        img = image_file(image, None) if image else None
        for mode in ("kv", "hybrid"):
            ra = a(prompt, img, mode=mode, max_new_tokens=tokens, ignore_eos=True)
            rb = b(prompt, img, mode=mode, max_new_tokens=tokens, ignore_eos=True)
            assert ra.token_ids == rb.token_ids, (prompt, mode)
            np.testing.assert_allclose(a.row.cache.stored(), b.row.cache.stored(), rtol=0, atol=1e-4)
    # teacher-forced logits of a hybrid prefill + decode steps
    e_a, e_b = a.row, b.row
    x = np.random.default_rng(0).standard_normal((37, a.manifest.decoder.hidden_size)).astype(np.float32) * 0.5
    la, lb = e_a.score(x, list(range(5, 12))), e_b.score(x, list(range(5, 12)))
    np.testing.assert_allclose(la, lb, rtol=0, atol=2e-4 * max(1.0, float(np.abs(lb).max())))
    # rope positions apart from the slots (a jump of 7 after row 20, as an M-RoPE image's rows leave one; kv mode, so
    # no step at slot 0 holds the jump): both graphs rotate by the positions input (GroupQueryAttention's
    # position_ids), not by the slot. (A uniform shift would change nothing: RoPE scores depend on differences only.)
    rows = np.arange(37)
    jumped = (rows + 7 * (rows >= 20))[None]
    toks = list(range(5, 12))
    ka = e_a.score(x, toks, "kv")
    sa, sb = e_a.score(x, toks, "kv", positions=jumped), e_b.score(x, toks, "kv", positions=jumped)
    np.testing.assert_allclose(sa, sb, rtol=0, atol=2e-4 * max(1.0, float(np.abs(sb).max())))
    assert np.abs(sa - ka).max() > 1e-2  # (the positions change the answer)
    assert int(e_a.cache.positions[0, e_a.cache.length - 1]) == 7 + e_a.cache.length - 1  # generated rows continue
    with pytest.raises(ValueError, match="consecutive positions in a step at slot 0"):  # ORT's first-prompt rule
        e_a.prefill(x[:8], "hybrid", positions=np.array([[0, 1, 2, 2, 2, 3, 4, 5]]))
    # lookahead on the gqa bundles: test_lookahead_bundles.py (the session's default exports)


def test_smolvlm_gqa_equals_portable(default_bundle, tmp_path_factory, tmp_path):
    from test_runtime_speed_paths import cache_readers

    layers = len(default_bundle.manifest()["kv"]["layers"])
    portable = _portable(default_bundle, tmp_path_factory)
    # Shape: the symbolic cache length is read off the input's metadata, not its data; no copy of the cache
    assert cache_readers(portable, tmp_path) <= {"MatMul", "FusedMatMul", "Shape"}
    check_same_answers(default_bundle.bundle, portable, layers)


def test_internvl_qwen3_gqa_equals_portable(tmp_path_factory):
    import test_internvl

    ex = test_internvl.exported(test_internvl.CASES[1], tmp_path_factory)  # Qwen3: q/k norms before RoPE
    check_same_answers(ex.bundle, _portable(ex, tmp_path_factory), len(ex.manifest()["kv"]["layers"]))


def test_gqa_needs_the_one_graph_decoder(default_bundle, tmp_path, capsys):
    from vlmrt.cli import main

    rc = main(["export", str(default_bundle.ckpt), str(tmp_path / "out"), "--attention", "gqa", "--context-step", "0",
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("vlmrt: error: --attention gqa needs the one-graph CPU decoder"), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, needle", [
    (lambda m: m["decoder"]["kind"].update(name="paged"), "bundle decoder kind 'paged' is not known to this vlmrt"),
    (lambda m: m["kv"]["layers"][1].update(kind="ssm"), r"bundle cache layer kind 'ssm' \(kv.layers\[1\]\) is not known"),
    (lambda m: m["kv"]["layers"][1].update(kind=["gqa_in_place"]), r"kv.layers\[1\].kind must be a string, not list"),
    (lambda m: m["decoder"]["kind"].update(name={"n": 1}), r"decoder.kind.name must be a string, not dict"),
    (lambda m: m["decoder"]["kind"].update(mask_input="attention_mask"), "decoder.kind has an unknown field 'mask_input'"),
    (lambda m: m["decoder"]["kind"].pop("seqlens_input"), "decoder.kind lacks the field 'seqlens_input'"),
    (lambda m: m["kv"]["layers"][0].update(kv_heads=0), r"kv.layers\[0\]: kv_heads and head_dim must be positive"),
    (lambda m: m["decoder"]["positions"].update(rows=3),  # (a graph of several rows gathers them: layers._gqa_rope)
     r"input 'position_ids' must be \[3, ar\] \(decoder.positions.rows\), not \[1, 'ar'\]"),
])
def test_unknown_or_inconsistent_decoder_kind_is_refused(default_bundle, tmp_path, change, needle):
    """The tagged unions (decoder.kind, kv.layers[i].kind) name kinds this vlmrt knows, each with its own fields only."""
    import shutil

    from vlmrt.format import manifest as mf

    b = tmp_path / "b"
    shutil.copytree(default_bundle.bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    change(m)
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(mf.BundleError, match=needle):
        mf.load(b, verify=False)


def test_packed_qkv_equals_split(tmp_path_factory, tmp_path):
    """A 4-bit decoder's q/k/v projection (one fused MatMulNBits) goes into GroupQueryAttention whole, its packed-QKV
    form (gqa_onnx.pack_qkv): no Split per layer, and the same logits and cache rows, bit for bit, as the graph with
    the Split put back."""
    import shutil

    from onnx import helper, numpy_helper

    from test_quant import bundle

    b = bundle("w4a8", tmp_path_factory)
    model = onnx.load(str(b / "decoder.onnx"), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(list(n.input[1:3]) == ["", ""] for n in gqa)
    assert "Split" not in {n.op_type for n in model.graph.node if n.output[0] in {g.input[0] for g in gqa}}
    m = json.loads((b / "manifest.json").read_text())
    heads = next(a.i for a in gqa[0].attribute if a.name == "num_heads")
    kv_heads, d = m["kv"]["layers"][0]["kv_heads"], m["kv"]["layers"][0]["head_dim"]
    nodes = []
    for n in model.graph.node:  # the Split put back in front of each op
        if n.op_type == "GroupQueryAttention":
            qkv = n.input[0]
            parts = [qkv + s for s in ("_q", "_k", "_v")]
            nodes.append(helper.make_node("Split", [qkv, qkv + "_sizes"], parts, axis=-1))
            model.graph.initializer.append(numpy_helper.from_array(
                np.array([heads * d, kv_heads * d, kv_heads * d], np.int64), qkv + "_sizes"))
            n.input[0], n.input[1], n.input[2] = parts
        nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    split = tmp_path / "split"
    shutil.copytree(b, split)
    onnx.save(model, str(split / "decoder.onnx"))
    a, s = VLM.load(b), VLM.load(split, verify=False)
    x = np.random.default_rng(0).standard_normal((21, m["decoder"]["hidden_size"])).astype(np.float32) * 0.5
    for mode in ("kv", "hybrid"):
        np.testing.assert_array_equal(a.row.score(x, [5, 9, 2, 7], mode), s.row.score(x, [5, 9, 2, 7], mode))
        np.testing.assert_array_equal(a.row.cache.stored(), s.row.cache.stored())
