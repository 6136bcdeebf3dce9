"""What users have, on an LFM2-VL bundle (family_cases.LFM2_CASES[0]: conv layers beside GroupQueryAttention, the
CPU default kind): `vlmrt run` with several images of different sizes, `--max-tiles` (LFM2-VL's processor setting of
that name) against transformers' processor at that setting, `--lookahead`; `vlmrt chat`; `vlmrt eval --reference`
(the torch modules behind the session interface: the NaFlex vision module's extra inputs); `vlmrt bench`; `vlmrt
batch` with a URL, a data URI and a conversation; `vlmrt serve` with two images and a follow-up. Each answer equals
transformers' or the in-process VLM's."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from family_cases import LFM2_CASES, lfm2_exported
from family_runner import cli_json
from vlmrt import cli
from vlmrt.runtime.pipeline import VLM

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

PROMPT = "What is in the image? Describe the colours."


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed + w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    return lfm2_exported(LFM2_CASES[0], tmp_path_factory)


@pytest.fixture(scope="module")
def images(ex):
    """A tiled image (a 3×2 grid + thumbnail at the fixture's 64² tiles), a wide one and a small single tile."""
    out = []
    for k, (w, h) in enumerate([(250, 160), (300, 90), (40, 40)]):
        p = ex.tmp / f"p{k}.png"
        picture(w, h).save(p)
        out.append(str(p))
    return out


def test_max_tiles_equals_the_processor_at_that_setting(ex, images, capsys):
    """--max-tiles 3 tiles as Lfm2VlImageProcessor(max_tiles=3): prompt ids and 24 greedy ids of transformers."""
    from fixtures_lfm2_vl import hf_generate, hf_processor

    model, _ = ex.hf()
    proc = hf_processor(ex.ckpt)
    proc.image_processor.max_tiles = 3
    ims = [Image.open(images[0])]
    ids, want = hf_generate(model, proc, ims, PROMPT, 24)
    full = cli_json(capsys, ex.bundle, "--image", images[0], "--prompt", PROMPT, "--max-new-tokens", 4)
    got = cli_json(capsys, ex.bundle, "--image", images[0], "--prompt", PROMPT, "--max-tiles", 3, "--max-new-tokens", 24,
                   "--ignore-eos")
    assert got["prompt_tokens"] == len(ids) < full["prompt_tokens"] and got["token_ids"] == want
    assert got["stats"]["image_tiles"] < full["stats"]["image_tiles"]


def test_lookahead_run_equals_plain(ex, images, capsys):
    args = [ex.bundle, "--image", images[1], "--image", images[2], "--prompt", "red blue red blue red blue",
            "--max-new-tokens", 24, "--ignore-eos"]
    assert cli_json(capsys, *args, "--lookahead", 3)["token_ids"] == cli_json(capsys, *args)["token_ids"]


def test_chat_command(ex, images, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd again?\n/stats\n/quit\n"))
    capsys.readouterr()
    assert cli.main(["chat", str(ex.bundle), "--image", images[0], "--max-new-tokens", "4", "--stop", "\x00"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip("\n").splitlines()) == 2 and "prompt tokens" in err and "caches:" in err


def test_eval_against_the_float_reference_is_exact(ex, capsys):
    """`vlmrt eval --reference CHECKPOINT`: the fp32 bundle against vlmrt's torch modules (the NaFlex tower fed its
    position weights and key mask by name): measured top-1 1.0, KL ~1e-11."""
    capsys.readouterr()
    assert cli.main(["eval", str(ex.bundle), "--reference", str(ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["first_token_match"] == 1.0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-7, r


def test_bench(ex, images, capsys):
    capsys.readouterr()
    assert cli.main(["bench", str(ex.bundle), "--image", images[0], "--prompt-tokens", "180", "--gen-tokens", "8",
                     "--runs", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the prompt padded with text to 180 tokens (179: the text's tokenization steps over it by one), 8 tokens decoded
    assert 170 <= r["prompt_tokens"] <= 180 and r["generated_tokens"] == 8 and r["image_tiles"] == 7, r


def test_batch_url_data_uri_and_conversation(ex, images, tmp_path, capsys):
    """`vlmrt batch`: an image by URL (a loopback server), one as a data URI, two of different sizes in one record,
    and a conversation: each answer is the in-process VLM's."""
    from http_images import serve_images

    raw = open(images[0], "rb").read()
    uri = "data:image/png;base64," + base64.b64encode(open(images[2], "rb").read()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[1]}},
                                         {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": "blue"}, {"role": "user", "content": "And the shapes?"}]
    vlm = VLM.load(ex.bundle)
    with serve_images({"/p.png": raw}) as base:
        records = [{"id": "url", "image": base + "/p.png", "prompt": PROMPT},
                   {"id": "uri", "image": uri, "prompt": PROMPT},
                   {"id": "two", "image": [images[0], images[2]], "prompt": PROMPT},
                   {"id": "conv", "messages": conv}]
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert cli.main(["batch", str(ex.bundle), "--input", str(src), "--output", str(out), "--max-new-tokens", "8",
                         "--allow-local-urls", "--quiet", "--json"]) == 0
    by = {json.loads(ln)["id"]: json.loads(ln) for ln in out.read_text().splitlines()}
    want = {"url": vlm(PROMPT, images[0], max_new_tokens=8).token_ids,
            "uri": vlm(PROMPT, images[2], max_new_tokens=8).token_ids,
            "two": vlm(PROMPT, images=[images[0], images[2]], max_new_tokens=8).token_ids}
    vlm.reset()
    "".join(vlm.chat(conv, max_new_tokens=8))
    want["conv"] = vlm.result.token_ids
    assert {k: by[k]["token_ids"] for k in want} == want


def test_serve_two_images_then_a_follow_up(ex, images):
    """`vlmrt serve`: two images of different sizes (data URIs), then a follow-up on the same conversation; both
    answers are the in-process VLM's, the follow-up reusing the first turn's rows (its image rows too)."""
    pytest.importorskip("starlette")
    from serve_client import post, start, uri

    vlm = VLM.load(ex.bundle)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri(Image.open(p))}}
                                         for p in (images[0], images[2])] + [{"type": "text", "text": PROMPT}]}]
    r = start(ex.bundle)
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


@pytest.mark.parametrize("quant, floor", [("w8a16", (0.8, 0.003)), ("w4a16g", (0.38, 0.13))])
def test_weight_only_precisions(ex, tmp_path, capsys, quant, floor):
    """The CPU precisions quantize the conv layers' projections too (MatMulNBits), GPTQ calibrating through them
    (export/cpu/calibrate_gptq.py: conv windows in its state); against the float reference on this hidden-64
    random decoder, measured: w8a16 top-1 0.845, KL 0.0012; w4a16g 0.43, KL 0.10 (its 4-bit blocks of 32 are half
    a row here)."""
    from vlmrt.export.pipeline import export

    b = export(str(ex.ckpt), tmp_path / quant, prefill_ar=LFM2_CASES[0].prefill_ar, quant=quant, progress=False)
    m = json.loads((b / "manifest.json").read_text())
    assert m["graphs"]["decode"]["precision"] == quant and m["graphs"]["decode"]["prepacked"]
    capsys.readouterr()
    assert cli.main(["eval", str(b), "--reference", str(ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["top1_agreement"] >= floor[0] and r["mean_kl"] < floor[1], r
