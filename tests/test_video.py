"""Video input (issue 32): frames sampled, resized and written into the prompt as transformers' SmolVLMProcessor +
SmolVLMVideoProcessor do, and greedy ids equal to generate's, on the tiny random SmolVLM checkpoints; the sources
(GIF, WebP, a folder of frames, mp4 through PyAV), the image cache across turns, bad input as one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import ASSETS

from vlmrt import cli
from vlmrt.runtime.media import video as V
from vlmrt.runtime.vlm import VLM

QUESTION = "What happens in the video?"
TINY_GIF = ASSETS / "no_time_for_that_tiny.gif"  # 24 frames × 70 ms: 1.68 s, shorter than the 4 s sampling window


def gif(path: Path, durations: list[int], size=(40, 30), seed=0) -> Path:
    """An animated GIF of len(durations) distinct frames (ms each)."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(len(durations)):
        x = rng.integers(0, 256, (size[1], size[0], 3)).astype(np.uint8)
        x[:, : (i * 3) % size[0]] = (i * 37) % 256  # a moving band: frames differ
        frames.append(Image.fromarray(x).quantize(64))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=durations, loop=0, disposal=1)
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {
        "short": TINY_GIF,
        "long": gif(d / "long.gif", [250] * 40, seed=1),  # 10 s: the first and last second are skipped
        "uneven": gif(d / "uneven.gif", [40, 900, 120, 60, 1500, 300, 80, 700], size=(23, 51), seed=2),
    }


def hf_video_processor(ckpt: Path):
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    from oracle import settings, video_settings, without_types

    pre, own = settings(ckpt)  # (either layout, as transformers reads it)
    vid = without_types(video_settings(ckpt))
    return SmolVLMProcessor(image_processor=SmolVLMImageProcessorPil(**without_types(pre)),
                            tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), video_processor=SmolVLMVideoProcessor(**vid),
                            chat_template=own["chat_template"], image_seq_len=own["image_seq_len"])


def hf_inputs(ex, src, question=QUESTION):
    """The processor's inputs for one user turn (the video, then the question) on the clip's decoded frames (every
    frame at the clip's constant rate, with its metadata): the processor samples them itself."""
    from transformers.video_utils import VideoMetadata

    clip = V.read_video(src)
    frames = np.stack([np.asarray(f) for f in clip.frames(np.arange(clip.total_frames))])
    proc = hf_video_processor(ex.ckpt)
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    meta = VideoMetadata(total_num_frames=clip.total_frames, fps=clip.fps, duration=clip.duration)
    return proc(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=True, return_tensors="pt")


_HF: dict = {}


def hf_answer(ex, src, n=24):
    """(prompt ids, pixels [frames, 3, S, S], greedy ids) of transformers, memoized per (case, clip)."""
    key = (str(ex.ckpt), str(src), n)
    if key not in _HF:
        inputs = hf_inputs(ex, src)
        ids = inputs["input_ids"][0].tolist()
        new = []
        if n:
            import oracle

            new = oracle.greedy_new_ids(ex.hf()[0], inputs, n, ignore_eos=True)
        _HF[key] = ids, inputs["pixel_values"][0].numpy(), list(new)
    return _HF[key]


def video_turn(src, question=QUESTION, **extra):
    return [{"role": "user", "content": [{"type": "video", "video": str(src), **extra}, {"type": "text", "text": question}]}]


def frame_pixels(prompt) -> np.ndarray:
    return np.stack([c.pixels[0] for _, c in prompt.images()])


@pytest.mark.parametrize("kind", ["short", "long", "uneven"])
def test_frames_pixels_and_prompt_ids_equal_transformers(default_bundle, clips, kind):
    """Sampling (which frames), resizing (torchvision's uint8 resize, twice) and the prompt text equal the processor's:
    pixels to float rounding of the normalization (measured max 6e-8), prompt ids exactly."""
    ex = default_bundle
    ids, pixels, _ = hf_answer(ex, clips[kind], 0)
    vlm = VLM.load(ex.bundle)
    p = vlm.prompt(video_turn(clips[kind]))
    assert p.ids == ids
    got = frame_pixels(p)
    assert got.shape == pixels.shape
    np.testing.assert_allclose(got, pixels, rtol=0, atol=1e-6)
    text = vlm.bundle.tokenizer.decode(p.ids, skip_special_tokens=False)
    n = len(got)
    assert f"series of {V.number_words(n)} frames" in text and text.count("Frame from ") == n


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
@pytest.mark.parametrize("kind", ["short", "long", "uneven"])
def test_greedy_ids_equal_transformers(default_bundle, clips, kind, mode):
    ex = default_bundle
    ids, _, want = hf_answer(ex, clips[kind])
    assert len(set(want)) > 4
    vlm = VLM.load(ex.bundle)
    r = vlm(QUESTION, video=str(clips[kind]), mode=mode, max_new_tokens=24, ignore_eos=True)
    assert r.prompt_ids == ids and r.token_ids == want
    assert r.stats.videos == 1 and r.stats.video_frames == r.stats.images == len(frame_pixels(vlm.prompt(video_turn(clips[kind]))))


def test_nested_processor_config_takes_videos_as_transformers(tmp_path_factory, clips):
    """SmolVLM2's processor saved by transformers 5.24's save_pretrained (one processor_config.json, the video
    processor's settings nested in it, no video_preprocessor_config.json): the bundle takes videos (it does not say
    "this bundle takes no videos"), sampled and written into the prompt as transformers' processor does: 4 frames of
    the long clip, prompt ids and greedy ids equal."""
    from family_cases import nested

    ex = nested("smolvlm", tmp_path_factory)
    ids, _, want = hf_answer(ex, clips["long"])
    assert len(set(want)) > 4
    vlm = VLM.load(ex.bundle)
    r = vlm(QUESTION, video=str(clips["long"]), max_new_tokens=24, ignore_eos=True)
    assert r.prompt_ids == ids and r.token_ids == want
    assert r.stats.videos == 1 and r.stats.video_frames == 4


def test_sampling_equals_transformers_sample_frames():
    """sample_indices against SmolVLMVideoProcessor.sample_frames over clip lengths, rates and settings."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    from vlmrt.format.manifest import VideoSpec

    for fps, max_frames in ((1.0, 4), (1.0, 64), (2.0, 8), (0.5, 3)):
        proc = SmolVLMVideoProcessor(video_sampling={"fps": fps, "max_frames": max_frames, "video_size": {"longest_edge": 64}})
        spec = VideoSpec(fps, max_frames, "<video>", "", skip_secs=1.0, longest_edge=64, frame_size=64)
        for total, rate in ((1, 10.0), (2, 14.3), (24, 14.2857), (40, 4.0), (250, 25.0), (3000, 29.97), (17, 0.5)):
            clip = V.Clip("c", total, rate, total / rate, lambda i: [])
            want = proc.sample_frames(VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate))
            np.testing.assert_array_equal(V.sample_indices(clip, spec), want, err_msg=f"{fps} {max_frames} {total} {rate}")


def test_number_words_equal_num2words():
    from num2words import num2words

    for n in range(0, 2500):
        assert V.number_words(n) == num2words(n), n


def test_uint8_resize_equals_torchvision():
    """runtime/media/aa_resize.py against torchvision's tensor resize (uint8, antialiased), up and down, odd sizes."""
    import torch
    from torchvision.transforms.v2 import functional as tvF

    from vlmrt.runtime.media import aa_resize

    rng = np.random.default_rng(0)
    modes = {"lanczos": tvF.InterpolationMode.LANCZOS, "bicubic": tvF.InterpolationMode.BICUBIC,
             "bilinear": tvF.InterpolationMode.BILINEAR}
    for (h, w, oh, ow) in ((25, 14, 128, 74), (128, 74, 64, 64), (300, 451, 85, 128), (33, 200, 37, 17), (1, 9, 4, 4)):
        x = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        for name, mode in modes.items():
            ref = tvF.resize(torch.from_numpy(x).permute(2, 0, 1).contiguous(), [oh, ow], interpolation=mode, antialias=True)
            np.testing.assert_array_equal(aa_resize.resize(x, oh, ow, name), ref.permute(1, 2, 0).numpy(), err_msg=name)


def test_uneven_durations_give_the_frame_shown_at_each_time(clips):
    """An animated GIF's frame i (at the clip's average rate) is the one on screen at time i / fps."""
    src = Image.open(clips["uneven"])
    durations = [40, 900, 120, 60, 1500, 300, 80, 700]
    clip = V.read_video(clips["uneven"])
    assert clip.total_frames == 8 and clip.duration == pytest.approx(3.7) and clip.fps == pytest.approx(8 / 3.7)
    starts = np.cumsum([0] + durations[:-1])
    for i, f in enumerate(clip.frames(np.arange(8))):
        j = int(np.searchsorted(starts, i / clip.fps * 1000, side="right")) - 1
        src.seek(j)
        assert np.array_equal(np.asarray(f), np.asarray(src.convert("RGB"))), i


def test_follow_up_question_pays_only_for_new_tokens(default_bundle, clips):
    """A second question about the same video: every frame's embeddings from the image cache, the first turn's KV
    rows kept; the answer equals a fresh run of the whole conversation."""
    vlm = VLM.load(default_bundle.bundle)
    msgs = video_turn(clips["long"])
    first = "".join(vlm.chat(msgs, max_new_tokens=6, ignore_eos=True))
    s1 = vlm.result.stats
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    list(vlm.chat(msgs, max_new_tokens=6, ignore_eos=True))
    s2, got = vlm.result.stats, vlm.result.token_ids
    assert s1.images_cached == 0 and s2.images_cached == s2.video_frames == 4 and s2.vision_skipped
    assert s2.reused_prompt_tokens >= s1.prompt_tokens - default_bundle.case.prefill_ar
    fresh = VLM.load(default_bundle.bundle)
    list(fresh.chat(msgs, max_new_tokens=6, ignore_eos=True))
    assert fresh.result.token_ids == got


def test_folder_of_frames_and_webp_and_a_list_of_images(default_bundle, clips, tmp_path):
    """The same frames as a folder (numbered frame_2 before frame_10) at the GIF's rate, as an animated WebP, and as
    PIL images give the GIF's prompt."""
    vlm = VLM.load(default_bundle.bundle)
    clip = V.read_video(clips["long"])  # 40 frames of 250 ms: 4 fps
    frames = clip.frames(np.arange(clip.total_frames))
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, f in enumerate(frames):
        f.save(folder / f"frame_{i}.png")
    want = vlm.prompt(video_turn(clips["long"])).ids
    assert vlm.prompt(video_turn(folder, fps=4)).ids == want
    frames[0].save(tmp_path / "v.webp", save_all=True, append_images=frames[1:], duration=250, lossless=True)
    assert vlm.prompt(video_turn(tmp_path / "v.webp")).ids == want
    r = vlm("Describe.", video=frames, fps=4, max_new_tokens=3, ignore_eos=True)
    assert r.stats.video_frames == 4


def test_mp4_through_pyav_equals_transformers(default_bundle, tmp_path):
    """An mp4 read by PyAV (frame count and average rate from the stream, as transformers' read_video_pyav): the
    processor's prompt ids and pixels on the same decoded frames; a constant clip equals the same frames as a GIF."""
    av = pytest.importorskip("av")
    path = tmp_path / "v.mp4"
    rng = np.random.default_rng(3)
    with av.open(str(path), "w") as out:
        s = out.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        for i in range(70):  # 7 s
            x = rng.integers(0, 256, (32, 48, 3)).astype(np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(x, format="rgb24")):
                out.mux(pkt)
        for pkt in s.encode():
            out.mux(pkt)
    clip = V.read_video(path)
    assert (clip.total_frames, clip.fps) == (70, 10.0)
    ids, pixels, _ = hf_answer(default_bundle, path, 0)
    p = VLM.load(default_bundle.bundle).prompt(video_turn(path))
    assert p.ids == ids
    np.testing.assert_allclose(frame_pixels(p), pixels, rtol=0, atol=1e-6)


def cli_error(capsys, *args) -> str:
    assert cli.main(list(map(str, args))) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vlmrt: error: "), err
    return err


def test_cli_run_video(default_bundle, clips, capsys):
    ids, _, want = hf_answer(default_bundle, clips["short"])
    assert cli.main(["run", str(default_bundle.bundle), "--video", str(clips["short"]), "--prompt", QUESTION,
                     "--max-new-tokens", "24", "--ignore-eos", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == want and got["prompt_tokens"] == len(ids)


def test_bad_videos_are_one_line(default_bundle, clips, tmp_path, capsys):
    b = default_bundle.bundle
    run = ["run", b, "--prompt", "Hi", "--video"]
    empty = tmp_path / "empty.gif"
    empty.write_bytes(b"")
    assert "the file is empty" in cli_error(capsys, *run, empty)
    corrupt = tmp_path / "corrupt.gif"
    corrupt.write_bytes(TINY_GIF.read_bytes()[:300])
    assert "cannot read" in cli_error(capsys, *run, corrupt)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00\x01 not a video at all" * 50)
    assert "cannot read video" in cli_error(capsys, *run, junk)
    assert "video not found" in cli_error(capsys, *run, tmp_path / "nope.gif")
    folder = tmp_path / "frames"
    folder.mkdir()
    assert "--fps" in cli_error(capsys, *run, folder)
    Image.new("RGB", (8, 8)).save(folder / "0.png")
    assert "--fps is for a folder" in cli_error(capsys, *run, TINY_GIF, "--fps", 2)
    png = tmp_path / "still.png"
    Image.new("RGB", (8, 8)).save(png)
    assert "still PNG image, not a video" in cli_error(capsys, *run, png)


def test_one_frame_gif_is_a_one_frame_video(default_bundle, tmp_path):
    """A GIF of one frame is read as a video of one frame (as the processor reads it), not as an image."""
    path = gif(tmp_path / "one.gif", [500])
    ids, pixels, _ = hf_answer(default_bundle, path, 0)
    p = VLM.load(default_bundle.bundle).prompt(video_turn(path))
    assert p.ids == ids and len(frame_pixels(p)) == 1


def test_video_longer_than_the_context_is_refused_with_the_numbers(default_bundle, clips, capsys):
    """10 frames of the long GIF (--max-frames above the checkpoint's 4) do not fit CASES[0]'s 320 tokens: refused with
    the counts and the --max-frames that fits, which then runs."""
    long = clips["long"]
    err = cli_error(capsys, "run", default_bundle.bundle, "--video", long, "--prompt", "Hi", "--max-frames", 12)
    assert "video + prompt is" in err and "10 frames of" in err and "max context is 320" in err, err
    k = int(err.split("--max-frames ")[1].split(",")[0])
    assert 1 <= k < 10
    assert cli.main(["run", str(default_bundle.bundle), "--video", str(long), "--prompt", "Hi", "--max-frames", str(k),
                     "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["video_frames"] == k


def test_bundle_without_video_settings_refuses_video(default_bundle, tmp_path, capsys):
    import shutil

    b = tmp_path / "b"
    shutil.copytree(default_bundle.bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    m["prompt"]["video"] = None
    (b / "manifest.json").write_text(json.dumps(m))
    err = cli_error(capsys, "run", b, "--video", TINY_GIF, "--prompt", "Hi")
    assert "takes no videos" in err


def test_without_pyav_a_video_file_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_av(name, *a, **k):
        if name == "av":
            raise ImportError("no av")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_av)
    f = tmp_path / "v.mp4"
    f.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)
    with pytest.raises(V.VideoError, match=r"vlmrt\[video\]"):
        V.read_video(f)
    assert math.isclose(V.read_video(TINY_GIF).duration, 1.68)  # GIFs need no PyAV


def test_server_video_url_part_as_vllm_takes_it(default_bundle, tmp_path):
    """{"type": "video_url", "video_url": {"url": data URI | media-folder path}}: the answer of VLM.chat on the same
    video; a bad video is a 400 naming it, and so is a second video."""
    import base64

    from serve_client import post, start

    vlm = VLM.load(default_bundle.bundle)
    want = "".join(vlm.chat(video_turn(TINY_GIF), max_new_tokens=8))
    data = "data:image/gif;base64," + base64.b64encode(TINY_GIF.read_bytes()).decode()
    r = start(default_bundle.bundle, "--slots", "1", "--media-dir", str(ASSETS))
    try:
        for url in (data, TINY_GIF.name):
            body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                              {"type": "text", "text": QUESTION}]}], "max_tokens": 8}
            code, out, _ = post(r, body)
            assert code == 200 and out["choices"][0]["message"]["content"] == want, out
        bad = {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"junk" * 40).decode()}},
            {"type": "text", "text": "?"}]}]}
        code, out, _ = post(r, bad)
        assert code == 400 and out["error"]["message"].startswith("video 1: ") and "cannot read video" in out["error"]["message"]
        two = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data}}] * 2}]}
        code, out, _ = post(r, two)
        assert code == 400 and "at most 1" in out["error"]["message"]
    finally:
        r.stop()


def test_batch_records_with_video(default_bundle, clips, tmp_path, capsys):
    """JSONL records {"id", "video", "prompt"} (a relative path; a folder with "fps"): the answers of vlmrt run; a bad
    video is that record's error line."""
    import shutil

    shutil.copy(TINY_GIF, tmp_path / "clip.gif")
    frames = tmp_path / "frames"
    frames.mkdir()
    clip = V.read_video(TINY_GIF)
    for i, f in enumerate(clip.frames(np.arange(clip.total_frames))):
        f.save(frames / f"{i:03d}.png")
    (tmp_path / "bad.gif").write_bytes(b"GIF89a broken")
    recs = [{"id": "a", "video": "clip.gif", "prompt": QUESTION}, {"id": "b", "video": "frames", "fps": clip.fps, "prompt": QUESTION},
            {"id": "c", "video": "bad.gif", "prompt": QUESTION}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(default_bundle.bundle), "--input", str(src), "--output", str(out),
                     "--max-new-tokens", "8", "--quiet"]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    want = "".join(VLM.load(default_bundle.bundle).chat(video_turn(TINY_GIF), max_new_tokens=8))
    assert rows["a"]["text"] == want and rows["b"]["text"] == want
    assert "cannot read" in rows["c"]["error"]


def test_chat_repl_video_then_a_follow_up(default_bundle, clips):
    """`vlmrt chat --video` (and /video): the video goes with the first turn; the follow-up reuses its frames."""
    import io

    from vlmrt.chat_repl import repl
    from vlmrt.runtime.prompt.conversation import VideoSource

    vlm = VLM.load(default_bundle.bundle)
    out, err = io.StringIO(), io.StringIO()
    script = f"{QUESTION}\nAnd then?\n/reset\n/video {clips['uneven']}\nNow this one?\n/video /no/such.gif\nHm?\n"
    assert repl(vlm, dict(max_new_tokens=4), videos=[VideoSource(str(TINY_GIF))], stdin=io.StringIO(script),
                stdout=out, stderr=err) == 0
    log = err.getvalue()
    turns = [ln for ln in log.splitlines() if ln.startswith("[") and "prompt tokens" in ln]
    assert len(turns) == 3, log
    # the follow-up: the frames' embeddings cached, the first turn's rows kept; the other video is encoded
    assert " 0 reused" in turns[0] and "vision skipped (cached)" in turns[1] and "skipped" not in turns[2]
    assert "vlmrt: error: video not found: /no/such.gif" in log
    assert len(out.getvalue().splitlines()) == 3
