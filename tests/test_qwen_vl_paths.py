"""What users have, on a Qwen3-VL bundle (family_cases.QWEN_CASES[1]: M-RoPE positions, DeepStack's row input, the
rows_dynamic CPU kind): `vlmrt run` with several images of different grids and `--lookahead`; `vlmrt chat`; `vlmrt
eval --reference` (the torch modules behind the session interface: the tower's host inputs by name, the decoder's
row input); `vlmrt bench`; `vlmrt batch` with a URL, a data URI, two images and a conversation; `vlmrt serve` with
two images and a follow-up. Each answer equals transformers' or the in-process VLM's (itself held to transformers by
test_qwen_vl.py and the conformance runner)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from family_cases import QWEN_CASES, qwen_exported
from family_runner import cli_json
from vlmrt import cli
from vlmrt.runtime.pipeline import VLM

pytest.importorskip("transformers")

PROMPT = "What is in the image? Describe the colours."


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed + w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    return qwen_exported(QWEN_CASES[1], tmp_path_factory)


@pytest.fixture(scope="module")
def images(ex):
    """Three grids: a photo-sized image (resized down to the processor's max_pixels), a wide one, a small one (up to
    min_pixels)."""
    out = []
    for k, (w, h) in enumerate([(250, 160), (300, 90), (40, 40)]):
        p = ex.tmp / f"p{k}.png"
        picture(w, h).save(p)
        out.append(str(p))
    return out


def test_several_images_and_lookahead_equal_transformers(ex, images, capsys):
    """Three images of different grids in one `vlmrt run`: 24 greedy ids = transformers'; --lookahead 3 the same."""
    import oracle

    model, proc = ex.hf()
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": PROMPT}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[Image.open(p).convert("RGB") for p in images], return_tensors="pt")
    want = oracle.greedy_new_ids(model, inputs, 24, ignore_eos=True)
    args = [ex.bundle, *[x for p in images for x in ("--image", p)], "--prompt", PROMPT, "--max-new-tokens", 24,
            "--ignore-eos"]
    got = cli_json(capsys, *args)
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1] and got["token_ids"] == want
    la = cli_json(capsys, *args, "--lookahead", 3)
    assert la["token_ids"] == want and la["stats"]["drafted_tokens"] > 0  # (drafts verified, with zero row input)


def test_chat_command(ex, images, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd again?\n/stats\n/quit\n"))
    capsys.readouterr()
    assert cli.main(["chat", str(ex.bundle), "--image", images[0], "--max-new-tokens", "4", "--stop", "\x00"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip("\n").splitlines()) == 2 and "prompt tokens" in err and "caches:" in err


def test_eval_against_the_float_reference_is_exact(ex, capsys):
    """`vlmrt eval --reference CHECKPOINT`: the fp32 bundle against vlmrt's torch modules (the tower fed its rotary,
    position interpolation and mask inputs by name; the decoder its DeepStack rows)."""
    capsys.readouterr()
    assert cli.main(["eval", str(ex.bundle), "--reference", str(ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["first_token_match"] == 1.0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-7, r


def test_bench(ex, images, capsys):
    capsys.readouterr()
    assert cli.main(["bench", str(ex.bundle), "--image", images[0], "--prompt-tokens", "180", "--gen-tokens", "8",
                     "--runs", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 170 <= r["prompt_tokens"] <= 180 and r["generated_tokens"] == 8 and r["image_tiles"] == 1, r


def test_batch_url_data_uri_and_conversation(ex, images, tmp_path, capsys):
    """`vlmrt batch`: an image by URL (a loopback server), one as a data URI, two of different grids in one record,
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
    """`vlmrt serve`: two images of different grids (data URIs), then a follow-up on the same conversation; both
    answers are the in-process VLM's, the follow-up reusing the first turn's rows."""
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
