"""The re-scored 4-bit lm head (lm_head=w4a8r / w4a16r, export/cpu/rescored_head.py): the graph's logits are the
4-bit head's with its TOP best entries replaced by the per-row int8 rows' dot products in float, checked against
numpy on a random head; and the precisions' parsing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmrt.export.cpu import quantize, rescored_head


def head_session(w_kn: np.ndarray, head: str | None):
    """hidden [3, K] -> logits [3, V]: the float head, or quantized as quantize_decoder does for `head`."""
    import onnxruntime as ort

    g = helper.make_graph([helper.make_node("MatMul", ["hidden", "w"], ["logits"], name="lm")], "g",
                          [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [3, w_kn.shape[0]])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w_kn, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    if head is not None:
        model = quantize.quantize_decoder(model, "fp32", head, "logits")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), model


@pytest.mark.parametrize("head", ["w4a16r", "w4a8r"])
def test_rescored_head_replaces_the_top_logits_with_int8_rows(head):
    rng = np.random.default_rng(3)
    k, v = 64, 500
    w = rng.standard_normal((k, v)).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    s, model = head_session(w, head)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 1 and "TopK" in ops and "ScatterElements" in ops
    (got,) = s.run(None, {"hidden": x})
    plain4, _ = head_session(w, head.replace("r", ""))  # the same 4-bit head without the re-scoring
    (raw,) = plain4.run(None, {"hidden": x})
    rows, scales = quantize.int8_rows(np.ascontiguousarray(w.T))
    exact = (x @ rows.T.astype(np.float32)) * scales  # [3, V]: every logit from the int8 rows
    for r in range(3):
        top = np.argsort(-raw[r], kind="stable")[: rescored_head.TOP]
        np.testing.assert_allclose(got[r, top], exact[r, top], rtol=1e-5, atol=1e-4)
        rest = np.setdiff1d(np.arange(v), top)
        np.testing.assert_array_equal(got[r, rest], raw[r, rest])  # outside the candidates: the 4-bit head's
        assert got[r].argmax() == top[np.argmax(exact[r, top])]  # the greedy pick: the rows' best candidate
    assert not np.allclose(got, raw)  # the re-scoring changed logits (4-bit and int8 rows differ)
    float_logits = x @ w
    # the re-scored candidates are nearer the float head than the 4-bit head's own values
    top = np.argsort(-raw, axis=1)[:, : rescored_head.TOP]
    err = lambda a: np.abs(np.take_along_axis(a - float_logits, top, 1)).mean()  # noqa: E731
    assert err(got) < 0.3 * err(raw)


def test_parse_rescored_precisions():
    assert quantize.parse("w4a8o")["lm_head"] == "w4a8r" and quantize.parse("w4a16o")["lm_head"] == "w4a16r"
    assert quantize.parse("decode=w4a8,lm_head=w4a8r")["lm_head"] == "w4a8r"
    for spec in ("w4a8r", "decode=w4a8r", "vision=w4a16r"):
        with pytest.raises(quantize.QuantError, match="lm head only"):
            quantize.parse(spec)


@pytest.mark.parametrize("case, tied", [(1, True), (0, False)])
def test_a_tied_heads_rows_are_the_embedding_tables_bytes(case, tied, tmp_path_factory):
    """A plain w4a8o export re-scores from the head's per-row int8 weights; under a tied head those are the host's
    int8 embedding table and its scales, byte for byte: the graph reads them from embed.npy / embed_scale.npy (one copy
    on disk and in the page cache) and decoder.data does not hold them; an untied head keeps its own rows. Either way
    the bundle answers as it did with its own copy (the mapping holds the same bytes)."""
    import json

    from conftest import CASES, exported
    from vlmrt.export.pipeline import export
    from vlmrt.runtime.vlm import VLM

    ex = exported(CASES[case], tmp_path_factory)
    b = export(str(ex.ckpt), tmp_path_factory.mktemp("tied") / "b", prefill_ar=ex.case.prefill_ar,
               max_seq_len=ex.case.max_seq_len, quant="w4a8o", progress=False)
    g = json.loads((b / "manifest.json").read_text())["graphs"]["decode"]
    rows = {w["name"]: w for w in g["mapped_weights"] if w["name"].startswith("lm_head_rescore_")}
    table, scale = np.load(b / "embed.npy"), np.load(b / "embed_scale.npy")
    assert rows["lm_head_rescore_rows"]["shape"] == list(table.shape)
    if tied:
        assert (rows["lm_head_rescore_rows"]["file"], rows["lm_head_rescore_scales"]["file"]) == ("embed.npy", "embed_scale.npy")
        assert {"embed.npy", "embed_scale.npy"} <= set(g["data_files"])
        assert table.tobytes() not in (b / "decoder.data").read_bytes()  # not a second copy
    else:
        assert rows["lm_head_rescore_rows"]["file"] == "decoder.data"
    w = rows["lm_head_rescore_rows"]
    mapped = np.fromfile(b / w["file"], np.int8, count=w["length"], offset=w["offset"]).reshape(w["shape"])
    assert np.array_equal(mapped, table) == tied
    vlm = VLM.load(b)
    r = vlm("What is in the image?", max_new_tokens=8, ignore_eos=True)
    assert len(r.token_ids) == 8
