"""`vlmrt export --target htp` of a Qwen3-VL checkpoint (M-RoPE, DeepStack; family_cases.QWEN_CASES[1]'s weights):
static graphs with 3-row positions in prefill and decode, DeepStack's row input in both, the tower's masks at the
HTP's mask value; compiled into QNN context binaries and run on the HTP simulator, whose greedy choices on an image
prompt (a held-in image: vlmrt's calibration set) are the CPU EP's over the same QDQ graphs in both modes, as
test_qnn_context.py holds them for SmolVLM (teacher-forced on the CPU EP's tokens, parting only where its best two
logits are within TIE). About 2.5 min on 2 cores: the export (calibration on vlmrt's samples) is most of it."""

from __future__ import annotations

import numpy as np
import pytest

from family_cases import QWEN_CASES
from test_qnn_context import TIE
from vlmrt.format import manifest as mf
from vlmrt.runtime.vlm import VLM

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_qnn")

PROMPT = "What is in the image? Describe the colours."


@pytest.fixture(scope="module")
def htp_bundle(tmp_path_factory):
    from fixtures_qwen import make_full_checkpoint
    from vlmrt.export.pipeline import export

    case = QWEN_CASES[1]
    root = tmp_path_factory.mktemp("qwen3-vl-htp")
    ckpt = make_full_checkpoint(case.kind, root / "ckpt", seed=case.seed)
    return export(str(ckpt), root / "bundle", prefill_ar=case.prefill_ar, max_seq_len=384, target="htp",
                  keep_qdq=True, progress=False)


def test_static_graphs_take_the_positions_rows_and_deepstack(htp_bundle):
    m = mf.load(htp_bundle)
    assert m.target["name"] == "htp" and m.decoder.kind.name == "rows_static" and m.decoder.positions.op == "mrope"
    for name, ar in (("prefill", m.decoder.prefill_ar), ("decode", 1)):
        g = m.graphs[name]
        assert g.input("position_ids").shape == [3, ar]
        assert g.input(m.decoder.row_input.input).shape == [ar, 3 * m.decoder.hidden_size]
    assert m.vision.params["mask_value"] == -100.0 and m.vision.row_outputs == ["deepstack_0", "deepstack_1", "deepstack_2"]
    assert m.kv.dtype == "uint8" and set(m.kv.encodings) == {"prefill", "decode"}


def test_simulator_equals_the_cpu_ep(htp_bundle):
    from conftest import image_file

    cpu, npu = VLM.load(htp_bundle), VLM.load(htp_bundle, device="htp")
    image = image_file("chelsea.png", None)
    p = cpu.prompt(PROMPT, [image])
    ar = cpu.manifest.decoder.prefill_ar
    assert any(o // ar != (o + c.n_tokens - 1) // ar for o, c in p.images())  # the image straddles a block
    for mode in ("hybrid", "kv"):
        want = cpu(PROMPT, images=[image], mode=mode, max_new_tokens=16, ignore_eos=True)
        assert len(set(want.token_ids)) > 4
        xc, xn = cpu.decoder_inputs(cpu.prompt(PROMPT, [image])), npu.decoder_inputs(npu.prompt(PROMPT, [image]))
        np.testing.assert_array_equal(xc.positions, xn.positions)
        lc = cpu.row.score(xc.embeds, want.token_ids, mode, positions=xc.positions, rows=xc.rows)
        ln = npu.row.score(xn.embeds, want.token_ids, mode, positions=xn.positions, rows=xn.rows)
        top2 = np.sort(lc, axis=-1)[:, -2:]
        close = top2[:, 1] - top2[:, 0] <= TIE
        assert (lc.argmax(-1) == want.token_ids).all()
        parted = [i for i in range(16) if ln[i].argmax() != want.token_ids[i]]
        assert all(close[i] for i in parted), (mode, parted, (top2[:, 1] - top2[:, 0]).round(3).tolist())
        assert len(parted) <= 2, (mode, parted)
