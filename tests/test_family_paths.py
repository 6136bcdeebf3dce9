"""What users have, one check per command, for each family with a paths case (family_cases.FamilyCases.paths:
Qwen3-VL's QWEN_CASES[1]: M-RoPE positions, DeepStack's row input, the gqa_in_place CPU kind; LFM2-VL's
LFM2_CASES[0]: conv layers beside GroupQueryAttention): `vlmrt chat`; `vlmrt eval --reference` exact (the torch
modules behind the session interface: the tower's host inputs by name, the decoder's row input); `vlmrt bench`;
`vlmrt batch` with a URL, a data URI, two images in one record and a conversation; `vlmrt serve` with two images and a
follow-up; each quantized precision the family lists (FamilyCases.quant_floors) against the float reference. Each
answer equals the in-process VLM's (itself held to transformers by the family's own tests and the conformance runner).
The family-only paths stay in the family's file (test_qwen_vl_paths.py, test_lfm2_vl_paths.py)."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass

import pytest
from PIL import Image

from family_cases import FAMILIES
from family_runner import three_images
from vlmrt import cli
from vlmrt.runtime.vlm import VLM

pytest.importorskip("transformers")

PROMPT = "What is in the image? Describe the colours."
PATHS = [name for name, fc in FAMILIES.items() if fc.paths is not None]
QUANT = [(name, quant, floor) for name in PATHS for quant, floor in FAMILIES[name].quant_floors]


@dataclass
class PathCase:
    family: str
    ex: object  # conftest.Exported
    images: list  # paths of three images of different sizes


def exported(family: str, tmp_path_factory):
    fc = FAMILIES[family]
    return fc.exported(fc.cases[fc.paths.case], tmp_path_factory)


@pytest.fixture(scope="module", params=PATHS)
def pc(request, tmp_path_factory) -> PathCase:
    """The family's paths case and three images of different sizes (family_runner.three_images)."""
    ex = exported(request.param, tmp_path_factory)
    return PathCase(request.param, ex, three_images(ex))


def test_chat_command(pc, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd again?\n/stats\n/quit\n"))
    capsys.readouterr()
    assert cli.main(["chat", str(pc.ex.bundle), "--image", pc.images[0], "--max-new-tokens", "4", "--stop", "\x00"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip("\n").splitlines()) == 2 and "prompt tokens" in err and "caches:" in err


def test_eval_against_the_float_reference_is_exact(pc, capsys):
    """`vlmrt eval --reference CHECKPOINT`: the fp32 bundle against vlmrt's torch modules (the tower fed its extra
    inputs by name, the decoder its row input if it has one): top-1 1.0, KL below 1e-7."""
    capsys.readouterr()
    assert cli.main(["eval", str(pc.ex.bundle), "--reference", str(pc.ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["first_token_match"] == 1.0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-7, r


def test_bench(pc, capsys):
    """`vlmrt bench` with an image: the prompt padded with text to 180 tokens (the text's tokenization may step over
    it by one), 8 tokens decoded, the image's tiles counted (FamilyCases.paths.bench_tiles)."""
    capsys.readouterr()
    assert cli.main(["bench", str(pc.ex.bundle), "--image", pc.images[0], "--prompt-tokens", "180", "--gen-tokens", "8",
                     "--runs", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tiles = FAMILIES[pc.family].paths.bench_tiles
    assert 170 <= r["prompt_tokens"] <= 180 and r["generated_tokens"] == 8 and r["image_tiles"] == tiles, r


def test_batch_url_data_uri_and_conversation(pc, tmp_path, capsys):
    """`vlmrt batch`: an image by URL (a loopback server), one as a data URI, two of different sizes in one record,
    and a conversation: each answer is the in-process VLM's."""
    from http_images import serve_images

    images = pc.images
    raw = open(images[0], "rb").read()
    uri = "data:image/png;base64," + base64.b64encode(open(images[2], "rb").read()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[1]}},
                                         {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": "blue"}, {"role": "user", "content": "And the shapes?"}]
    vlm = VLM.load(pc.ex.bundle)
    with serve_images({"/p.png": raw}) as base:
        records = [{"id": "url", "image": base + "/p.png", "prompt": PROMPT},
                   {"id": "uri", "image": uri, "prompt": PROMPT},
                   {"id": "two", "image": [images[0], images[2]], "prompt": PROMPT},
                   {"id": "conv", "messages": conv}]
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert cli.main(["batch", str(pc.ex.bundle), "--input", str(src), "--output", str(out), "--max-new-tokens",
                         "8", "--allow-local-urls", "--quiet", "--json"]) == 0
    by = {json.loads(ln)["id"]: json.loads(ln) for ln in out.read_text().splitlines()}
    want = {"url": vlm(PROMPT, images[0], max_new_tokens=8).token_ids,
            "uri": vlm(PROMPT, images[2], max_new_tokens=8).token_ids,
            "two": vlm(PROMPT, images=[images[0], images[2]], max_new_tokens=8).token_ids}
    vlm.reset()
    "".join(vlm.chat(conv, max_new_tokens=8))
    want["conv"] = vlm.result.token_ids
    assert {k: by[k]["token_ids"] for k in want} == want


def test_serve_two_images_then_a_follow_up(pc):
    """`vlmrt serve`: two images of different sizes (data URIs), then a follow-up on the same conversation; both
    answers are the in-process VLM's, the follow-up reusing the first turn's rows."""
    pytest.importorskip("starlette")
    from serve_client import post, start, uri

    vlm = VLM.load(pc.ex.bundle)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri(Image.open(p))}}
                                         for p in (pc.images[0], pc.images[2])] + [{"type": "text", "text": PROMPT}]}]
    r = start(pc.ex.bundle)
    try:
        for turn in range(2):
            status, body, _ = post(r, {"model": "x", "messages": msgs, "max_tokens": 8, "temperature": 0})
            assert status == 200, body
            got = body["choices"][0]["message"]["content"]
            assert got == "".join(vlm.chat(msgs, max_new_tokens=8)), turn
            msgs = msgs + [{"role": "assistant", "content": got}, {"role": "user", "content": "And the shapes?"}]
        assert vlm.result.stats.reused_prompt_tokens > 0
    finally:
        r.stop()


@pytest.mark.parametrize("family, quant, floor", QUANT, ids=[f"{f}-{q}" for f, q, _ in QUANT])
def test_quantized_precision_tracks_the_float_reference(family, quant, floor, tmp_path_factory, tmp_path, capsys):
    """Each precision of FamilyCases.quant_floors exported from the paths case (its decoder's MatMulNBits prepacked)
    answers close to the float reference: `vlmrt eval --reference` top-1 and mean KL within the measured floors
    (family_cases.py says what was measured: through M-RoPE and DeepStack for Qwen-VL's GPTQ calibration, through
    the conv layers for LFM2-VL's)."""
    from vlmrt.export.pipeline import export

    ex = exported(family, tmp_path_factory)
    b = export(str(ex.ckpt), tmp_path / quant, prefill_ar=ex.case.prefill_ar, quant=quant, progress=False)
    m = json.loads((b / "manifest.json").read_text())
    assert m["graphs"]["decode"]["precision"] == quant and m["graphs"]["decode"]["prepacked"]
    capsys.readouterr()
    assert cli.main(["eval", str(b), "--reference", str(ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["top1_agreement"] >= floor[0] and r["mean_kl"] < floor[1], r
