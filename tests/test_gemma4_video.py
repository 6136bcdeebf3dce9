"""Gemma 4 video (issue 45): frames sampled, resized and written into the prompt as transformers' Gemma4Processor +
Gemma4VideoProcessor do (transformers' default uniform sampling, each frame at the video processor's soft-token
budget resized with torchvision's uint8 resize, "MM:SS <boi><|video|>×n<eoi>" per frame), and greedy ids equal to
Gemma4ForConditionalGeneration.generate on the tiny fixture (tests/fixtures_gemma4.py: 4 frames a video), through the
shared runner's export (family_cases.GEMMA4_CASES, max context 256)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import ASSETS

from vlmrt import cli
from vlmrt.runtime.media import video as V
from vlmrt.runtime.vlm import VLM

QUESTION = "What happens?"
TINY_GIF = ASSETS / "no_time_for_that_tiny.gif"  # 24 frames × 70 ms, 14 × 25


def gif(path: Path, durations: list[int], size=(40, 30), seed=0) -> Path:
    """An animated GIF of len(durations) distinct frames (ms each)."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(len(durations)):
        x = rng.integers(0, 256, (size[1], size[0], 3)).astype(np.uint8)
        x[:, : (i * 3) % size[0]] = (i * 37) % 256
        frames.append(Image.fromarray(x).quantize(64))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=durations, loop=0, disposal=1)
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from family_cases import GEMMA4_CASES, gemma4_exported

    return gemma4_exported(GEMMA4_CASES[0], tmp_path_factory)  # (the shared runner's export)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("g4clips")
    return {"short": TINY_GIF,
            "minutes": gif(d / "minutes.gif", [20000] * 5, size=(23, 51), seed=1),  # 100 s: 00:00 ... 01:00
            "few": gif(d / "few.gif", [300, 900, 200], size=(60, 20), seed=2)}  # 3 frames, fewer than num_frames


def hf_inputs(ckpt, src, num_frames: int | None = None, question=QUESTION):
    """Gemma4Processor's inputs for one user turn (the video, then the question) on every frame of the clip at its
    constant rate, with its metadata: the processor samples them itself (num_frames: the processor's, else the
    checkpoint's)."""
    from transformers.video_utils import VideoMetadata

    from fixtures_gemma4 import hf_processor

    clip = V.read_video(src)
    frames = np.stack([np.asarray(f) for f in clip.frames(np.arange(clip.total_frames))])
    proc = hf_processor(ckpt)
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    meta = VideoMetadata(total_num_frames=clip.total_frames, fps=clip.fps, duration=clip.duration)
    kw = {} if num_frames is None else {"num_frames": num_frames}
    return proc(text=[text], videos=[frames], video_metadata=[meta], return_tensors="pt", **kw)


def video_turn(src, question=QUESTION):
    return [{"role": "user", "content": [{"type": "video", "video": str(src)}, {"type": "text", "text": question}]}]


@pytest.mark.parametrize("kind", ["short", "minutes", "few"])
def test_prompt_ids_and_frame_patches_equal_the_processor(bundle, clips, kind):
    """Which frames (4 of 24, 4 of 5 at 20 s each: a timestamp past a minute; all 3 of a clip shorter than
    num_frames, which transformers refuses: its answer with num_frames 3), their patch rows (resized by
    torchvision's uint8 bicubic: bit-equal) and the prompt ids (timestamps, <boi> / <|video|> × tokens / <eoi> per
    frame, joined by spaces) equal the processor's."""
    clip = V.read_video(clips[kind])
    inputs = hf_inputs(bundle.ckpt, clips[kind], 3 if kind == "few" else None)
    ids = inputs["input_ids"][0].tolist()
    p = VLM.load(bundle.bundle).prompt(video_turn(clips[kind]))
    assert p.ids == ids
    want = inputs["pixel_values_videos"].numpy()  # [frames, 630, 48]: padded to the video's budget
    got = np.stack([c.pixels[0] for _, c in p.images()])  # padded to the vision graph's budget (the same here)
    assert got.shape == want.shape == (min(4, clip.total_frames), 630, 48)
    assert np.array_equal(got, want)
    video_id = json.loads((bundle.ckpt / "config.json").read_text())["video_token_id"]
    assert sum(len(c.rows) for _, c in p.images()) == ids.count(video_id)
    if kind == "minutes":
        text = VLM.load(bundle.bundle).bundle.tokenizer.decode(p.ids, skip_special_tokens=False)
        assert "00:00 <boi>" in text and "<eoi> 00:20 <boi>" in text and "<eoi> 01:00 <boi>" in text


_HF: dict = {}


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_greedy_ids_equal_generate(bundle, clips, mode, capsys):
    """`vlmrt run --video --max-frames 2` (the 4 frames of the checkpoint do not fit the 256-token context with an
    answer): the prompt ids and 24 greedy ids of Gemma4Processor (num_frames 2) + generate, in both modes (prefill
    blocks of 16 split every frame)."""
    from family_runner import cli_json
    from fixtures_gemma4 import hf_model

    import oracle

    if "greedy" not in _HF:  # (generate's answer once for both modes)
        inputs = hf_inputs(bundle.ckpt, clips["short"], 2)
        _HF["greedy"] = inputs["input_ids"].shape[1], oracle.greedy_new_ids(hf_model(bundle.ckpt), inputs, 24,
                                                                             ignore_eos=True)
    n, want = _HF["greedy"]
    assert len(set(want)) > 3
    got = cli_json(capsys, bundle.bundle, "--video", clips["short"], "--max-frames", 2, "--prompt", QUESTION,
                   "--mode", mode, "--max-new-tokens", 24, "--ignore-eos")
    assert got["prompt_tokens"] == n and got["token_ids"] == want


def test_a_video_over_the_context_is_refused_in_one_line(bundle, clips, capsys):
    """The checkpoint's 4 frames (~290 tokens) over the bundle's 256: one line giving the frames that fit."""
    capsys.readouterr()
    assert cli.main(["run", str(bundle.bundle), "--video", str(clips["short"]), "--prompt", QUESTION]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "4 frames of" in err and "--max-frames 3" in err, err


def test_server_video_url_part(bundle, clips):
    """The server's {"type": "video_url"} part (a data URI of a 3-frame GIF) answers as VLM.chat does."""
    from serve_client import post, start

    vlm = VLM.load(bundle.bundle)
    want = "".join(vlm.chat(video_turn(clips["few"]), max_new_tokens=8))
    data = "data:image/gif;base64," + base64.b64encode(clips["few"].read_bytes()).decode()
    r = start(bundle.bundle, "--slots", "1")
    try:
        body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data}},
                                                          {"type": "text", "text": QUESTION}]}], "max_tokens": 8}
        code, out, _ = post(r, body)
        assert code == 200 and out["choices"][0]["message"]["content"] == want, out
    finally:
        r.stop()


def host_of(bundle, tmp_path, image_soft: int, video: dict):
    """The family's host plan for the fixture checkpoint's config, tokenizer and processors, the image processor's
    max_soft_tokens and the video processor's settings replaced (no weights read)."""
    from vlmrt.families import family_for
    from vlmrt.families.checkpoint import Checkpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
                 "preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(bundle.ckpt / name, ckpt / name)
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    (ckpt / "preprocessor_config.json").write_text(json.dumps({**pre, "max_soft_tokens": image_soft}))
    vid = json.loads((ckpt / "video_preprocessor_config.json").read_text())
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({**vid, **video}))
    config = json.loads((ckpt / "config.json").read_text())
    fam = family_for(config)
    cfg = fam.config(config)
    return ckpt, fam.host(Checkpoint.open(ckpt), cfg, json.loads((ckpt / "tokenizer.json").read_text())), cfg


def test_frames_at_a_video_budget_below_the_images(bundle, tmp_path):
    """Image budget 280 soft tokens (the graph's 2520 patch rows), video 70 (its class default): each frame is
    resized within the video's 630 patches and padded to the graph's rows; its real rows equal
    Gemma4VideoProcessor's (frames of three shapes, each resized down or up) bit for bit. With 32 frames a video the
    default context takes one video. A video budget over the image's, or both fps and num_frames, is refused at
    export in one line."""
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    from oracle import video_settings, without_types
    from vlmrt.families.decoder import UnsupportedCheckpoint
    from vlmrt.runtime.media import image as img_ops

    ckpt, host, _ = host_of(bundle, tmp_path, 280, {"max_soft_tokens": 70})
    spec = host.video["frame_image"]
    assert spec.params == {"max_soft_tokens": 70, "pooling_kernel": 3, "graph_patches": 2520}
    proc = Gemma4VideoProcessor(**without_types(video_settings(ckpt)))
    rng = np.random.default_rng(0)
    for h, w in ((270, 480), (700, 100), (9, 13)):
        frames = rng.integers(0, 256, (2, h, w, 3)).astype(np.uint8)
        want = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")
        rows = want["pixel_values_videos"].numpy()
        real = int((want["video_position_ids"][0] != -1).all(-1).sum())
        for k in range(2):
            tiles = img_ops.preprocess(Image.fromarray(frames[k]), spec)
            assert tiles.pixels.shape == (1, 2520, 48)
            gh, gw = tiles.patch_grids[0]
            assert gh * gw == real and not tiles.pixels[0, real:].any()
            assert np.array_equal(tiles.pixels[0, :real], rows[k, :real]), (h, w)
    from vlmrt.families.gemma4 import default_max_context

    _, host32, cfg = host_of(bundle, tmp_path / "n32", 280, {"max_soft_tokens": 70, "num_frames": 32})
    ctx, why = default_max_context(cfg, host32)  # (32 frames × 78 > 2 images × 282: the video sets it)
    assert ctx == 3584 and why.startswith("a video of 32 frames"), why
    for video, why in (({"max_soft_tokens": 560}, "over the image processor's 280"),
                       ({"fps": 1.0}, "both fps and num_frames")):
        with pytest.raises(UnsupportedCheckpoint, match=why):
            host_of(bundle, tmp_path / why.split()[0], 280, video)


def test_uniform_sampling_equals_transformers():
    """sample_indices ("uniform") against BaseVideoProcessor.sample_frames (default_sample_indices_fn) by count and
    by fps over clip lengths and rates; a count over the clip's frames gives every frame (transformers refuses it)."""
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    from transformers.video_utils import VideoMetadata

    from vlmrt.format.manifest import VideoSpec

    for fps, count in ((0.0, 32), (0.0, 4), (1.0, None), (2.5, None)):
        kw = {"num_frames": count, "fps": None} if count else {"num_frames": None, "fps": fps}
        proc = Gemma4VideoProcessor(**kw)
        spec = VideoSpec(fps, count or 100_000, "<|video|>", "{timestamp} ", sampling="uniform")
        for total, rate in ((1, 10.0), (5, 0.05), (24, 14.2857), (40, 4.0), (250, 25.0), (3000, 29.97)):
            clip = V.Clip("c", total, rate, total / rate, lambda i: [])
            meta = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
            n = count if count else max(1, int(total / rate * fps))
            if n > total:
                with pytest.raises(ValueError, match="exceeds total_num_frames"):
                    proc.sample_frames(meta)
                want = proc.sample_frames(meta, num_frames=total, fps=None)
            else:
                want = proc.sample_frames(meta)
            np.testing.assert_array_equal(V.sample_indices(clip, spec), want, err_msg=f"{fps} {count} {total} {rate}")
        assert len(V.sample_indices(V.Clip("c", 250, 25.0, 10.0, lambda i: []), spec, 3)) == 3  # --max-frames 3


def test_the_tower_ignores_the_padding_rows(bundle):
    """What padding a frame to the vision graph's budget (the image's) rather than the video's relies on:
    transformers' tower gives a frame's soft tokens the same from 630 rows as from 2520 (the padding rows are masked
    out; measured 3e-7 of 2.0)."""
    import torch

    from fixtures_gemma4 import hf_model

    model = hf_model(bundle.ckpt)
    rng = np.random.default_rng(0)
    gh, gw = 24, 18
    pixels = torch.zeros(1, 2520, 48)
    pixels[0, : gh * gw] = torch.from_numpy(rng.random((gh * gw, 48)).astype(np.float32))
    pos = torch.full((1, 2520, 2), -1, dtype=torch.long)
    xs, ys = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    pos[0, : gh * gw] = torch.from_numpy(np.stack([xs, ys], -1).reshape(-1, 2))
    one = torch.tensor([1])
    with torch.no_grad():
        short = model.model.get_video_features(pixels[:, :630], pos[:, :630], num_frames_per_video=one).pooler_output[0]
        long = model.model.get_video_features(pixels, pos, num_frames_per_video=one).pooler_output[0]
    assert short.shape == long.shape == (gh * gw // 9, 64)
    np.testing.assert_allclose(long.numpy(), short.numpy(), rtol=0, atol=1e-5)
