"""`vlmrt export --target htp` of a Qwen3.5 checkpoint (family_cases.QWEN_CASES' first qwen3.5 case's weights): static
graphs whose Gated DeltaNet layers run the gated delta rule in plain ops (no LinearAttention, which the QNN EP lacks),
the conv windows and recurrent states as float32 graph I/O beside the uint8 K/V cache, valid_rows masking a padded
block; compiled into QNN context binaries and run on the HTP simulator, whose 16 greedy ids on a held-in text prompt
(its last prefill block padded) are the CPU EP's over the same QDQ graphs in both modes (measured equal). About 3 min
on 2 loaded cores, the export most of it."""

from __future__ import annotations

import pytest

from family_cases import QWEN_CASES
from vlmrt.format import manifest as mf
from vlmrt.runtime.vlm import VLM

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_qnn")

PROMPT = "Describe the colours of a sunset over the sea."


@pytest.fixture(scope="module")
def htp_bundle(tmp_path_factory):
    from fixtures_qwen import make_full_checkpoint
    from vlmrt.export.pipeline import export

    case = next(c for c in QWEN_CASES if c.kind == "qwen3_5")
    root = tmp_path_factory.mktemp("qwen3.5-htp")
    ckpt = make_full_checkpoint(case.kind, root / "ckpt", seed=case.seed)
    return export(str(ckpt), root / "bundle", prefill_ar=case.prefill_ar, max_seq_len=256, target="htp",
                  keep_qdq=True, progress=False)


def test_simulator_equals_the_cpu_ep_with_a_padded_block(htp_bundle):
    m = mf.load(htp_bundle)
    assert m.decoder.kind.name == "rows_static" and m.decoder.kind.valid_rows_input == "valid_rows"
    assert m.kv.dtype == "uint8" and set(m.kv.encodings["prefill"]) == {"key", "value"}
    for layer in m.kv.layers:
        for name in layer.inputs if layer.kind == "recurrent" else ():
            assert m.graphs["prefill"].input(name).dtype == "float32"
    cpu, npu = VLM.load(htp_bundle), VLM.load(htp_bundle, device="htp")
    for mode in ("hybrid", "kv"):
        want = cpu(PROMPT, mode=mode, max_new_tokens=16, ignore_eos=True)
        assert len(want.prompt_ids) % m.decoder.prefill_ar and len(set(want.token_ids)) > 4
        assert npu(PROMPT, mode=mode, max_new_tokens=16, ignore_eos=True).token_ids == want.token_ids, mode
