"""What users have, as one check per command, shared by the families' path tests (tests/test_qwen_vl_paths.py,
tests/test_lfm2_vl_paths.py): `vlmrt chat`; `vlmrt eval --reference` exact; `vlmrt bench`; `vlmrt batch` with a URL,
a data URI, two images in one record and a conversation; `vlmrt serve` with two images and a follow-up. Each answer
equals the in-process VLM's (itself held to transformers by the family's own tests and the conformance runner).
ex: the family's exported tiny case (conftest.Exported); images: paths of three images of different sizes."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from vlmrt import cli
from vlmrt.runtime.pipeline import VLM


def chat_command(ex, images, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd again?\n/stats\n/quit\n"))
    capsys.readouterr()
    assert cli.main(["chat", str(ex.bundle), "--image", images[0], "--max-new-tokens", "4", "--stop", "\x00"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip("\n").splitlines()) == 2 and "prompt tokens" in err and "caches:" in err


def eval_is_exact(ex, capsys):
    """`vlmrt eval --reference CHECKPOINT`: the fp32 bundle against vlmrt's torch modules (the tower fed its extra
    inputs by name, the decoder its row input if it has one): top-1 1.0, KL below 1e-7."""
    capsys.readouterr()
    assert cli.main(["eval", str(ex.bundle), "--reference", str(ex.ckpt), "--tokens", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["first_token_match"] == 1.0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-7, r


def bench(ex, images, capsys, tiles: int):
    """`vlmrt bench` with an image: the prompt padded with text to 180 tokens (the text's tokenization may step over
    it by one), 8 tokens decoded, the image's tiles counted."""
    capsys.readouterr()
    assert cli.main(["bench", str(ex.bundle), "--image", images[0], "--prompt-tokens", "180", "--gen-tokens", "8",
                     "--runs", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 170 <= r["prompt_tokens"] <= 180 and r["generated_tokens"] == 8 and r["image_tiles"] == tiles, r


def batch_url_data_uri_and_conversation(ex, images, tmp_path, capsys, prompt: str):
    """`vlmrt batch`: an image by URL (a loopback server), one as a data URI, two of different sizes in one record,
    and a conversation: each answer is the in-process VLM's."""
    from http_images import serve_images

    raw = open(images[0], "rb").read()
    uri = "data:image/png;base64," + base64.b64encode(open(images[2], "rb").read()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[1]}},
                                         {"type": "text", "text": prompt}]},
            {"role": "assistant", "content": "blue"}, {"role": "user", "content": "And the shapes?"}]
    vlm = VLM.load(ex.bundle)
    with serve_images({"/p.png": raw}) as base:
        records = [{"id": "url", "image": base + "/p.png", "prompt": prompt},
                   {"id": "uri", "image": uri, "prompt": prompt},
                   {"id": "two", "image": [images[0], images[2]], "prompt": prompt},
                   {"id": "conv", "messages": conv}]
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert cli.main(["batch", str(ex.bundle), "--input", str(src), "--output", str(out), "--max-new-tokens", "8",
                         "--allow-local-urls", "--quiet", "--json"]) == 0
    by = {json.loads(ln)["id"]: json.loads(ln) for ln in out.read_text().splitlines()}
    want = {"url": vlm(prompt, images[0], max_new_tokens=8).token_ids,
            "uri": vlm(prompt, images[2], max_new_tokens=8).token_ids,
            "two": vlm(prompt, images=[images[0], images[2]], max_new_tokens=8).token_ids}
    vlm.reset()
    "".join(vlm.chat(conv, max_new_tokens=8))
    want["conv"] = vlm.result.token_ids
    assert {k: by[k]["token_ids"] for k in want} == want


def serve_two_images_then_a_follow_up(ex, images, prompt: str):
    """`vlmrt serve`: two images of different sizes (data URIs), then a follow-up on the same conversation; both
    answers are the in-process VLM's, the follow-up reusing the first turn's rows."""
    pytest.importorskip("starlette")
    from serve_client import post, start, uri

    vlm = VLM.load(ex.bundle)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri(Image.open(p))}}
                                         for p in (images[0], images[2])] + [{"type": "text", "text": prompt}]}]
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

