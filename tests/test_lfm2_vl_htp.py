"""LFM2-VL on the HTP target (family_cases.LFM2_CASES[0]'s checkpoint): the conv rows are uint8 cache state like K/V,
with one (scale, zero point) per conv layer and graph (kv.encodings[graph]["conv"], calibrated from the rows each
graph writes: export/htp/calibrate.py RowsRecorder), the rows before slot 0 hold the reading graph's zero point and
hybrid mode re-quantizes prefill's rows to decode's (runtime/decode/kv_cache.py). The bundle runs on the QNN HTP simulator
with the CPU fallback off."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import on_npu
from family_cases import LFM2_CASES, lfm2_exported
from vlmrt.export.pipeline import export
from vlmrt.runtime.vlm import VLM

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
HELD_IN = "Explain how a bicycle works."  # one of eval.samples.CALIBRATION_PROMPTS (the default calibration)


@pytest.fixture(scope="module")
def htp(tmp_path_factory):
    ex = lfm2_exported(LFM2_CASES[0], tmp_path_factory)
    b = export(str(ex.ckpt), tmp_path_factory.mktemp("lfm2-htp") / "b", target="htp", max_seq_len=512, keep_qdq=True,
               progress=False)
    return ex, b


def test_conv_rows_are_uint8_state_with_their_encodings(htp):
    ex, b = htp
    m = json.loads((b / "manifest.json").read_text())
    convs = [layer for layer in m["kv"]["layers"] if layer["kind"] == "conv"]
    assert m["kv"]["dtype"] == "uint8" and len(convs) == 3
    for g in ("prefill", "decode"):
        enc = m["kv"]["encodings"][g]
        assert len(enc["conv"]) == 3 and len(enc["key"]) == len(enc["value"]) == 1
        assert all(s > 0 and 0 <= z <= 255 for s, z in enc["conv"])
        ins = {t["name"]: t for t in m["graphs"][g]["inputs"]}
        outs = {t["name"]: t for t in m["graphs"][g]["outputs"]}
        for layer in convs:
            assert ins[layer["state_input"]]["dtype"] == outs[layer["state_output"]]["dtype"] == "uint8"
            assert ins[layer["state_input"]]["shape"] == [layer["width"], layer["channels"]]
    # the CPU EP's simulation of the QDQ bundle tracks the float reference (measured: top-1 0.875, KL 0.0050 on this
    # hidden-64 random decoder; without the conv rows' zero point before slot 0: 0.777 / 0.0119; with the vision key
    # mask at float32's lowest instead of the HTP's -100 (export/pipeline.py _tile_params): 0.705 / 0.044)
    from vlmrt.eval import accuracy, samples

    v = VLM.load(b)
    r = accuracy.evaluate(v, accuracy.load_reference(ex.ckpt, v), samples.default_samples(), tokens=16)
    assert r["top1_agreement"] >= 0.84 and r["mean_kl"] < 0.008, r


def test_simulator_equals_the_cpu_ep_on_a_held_in_case(htp):
    """--device htp (the context binaries on the simulator, no CPU fallback): after a held-in prompt's prefill the
    logits and every K/V and conv row are the CPU EP's within a few quantization steps (measured: logits 0.37 (kv) /
    0.28 (hybrid) of ~3, rows within 7 / 4 uint8 steps), and its 8 greedy ids are the CPU EP's in both modes (on this random decoder,
    whose top logits are close, the sim and the CPU EP parted after 0-5 tokens on 8 of 12 calibration cases × modes
    tried, docs/lfm2-vl.md)."""
    _, b = htp
    cpu, npu = VLM.load(b), VLM.load(b, device="htp")
    on_npu(npu)
    ids = cpu.prompt(HELD_IN).ids
    for mode in ("kv", "hybrid"):
        a, h = cpu.row.prefill(cpu.scheduler.embed(ids), mode), npu.row.prefill(npu.scheduler.embed(ids), mode)
        assert a.argmax() == h.argmax() and np.abs(a - h).max() < 0.5, mode
        n = len(ids)
        for x, y in zip([cpu.row.cache.stored()] + [c.data[: c.spec.width + n] for c in cpu.row.cache.states["conv"].rows],
                        [npu.row.cache.stored()] + [c.data[: c.spec.width + n] for c in npu.row.cache.states["conv"].rows]):
            assert np.abs(x.astype(int) - y.astype(int)).max() <= 8, mode
        want = cpu(HELD_IN, max_new_tokens=8, ignore_eos=True, mode=mode).token_ids
        assert npu(HELD_IN, max_new_tokens=8, ignore_eos=True, mode=mode).token_ids == want, mode
