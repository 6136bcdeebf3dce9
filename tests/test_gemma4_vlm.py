"""Gemma 4 as a registered family (families/gemma4): a tiny random Gemma4ForConditionalGeneration saved by
transformers (tests/fixtures_gemma4.py) through `vlmrt export` (exported once per session, prefill blocks of 16 so
blocks split the images) and `vlmrt run`: the prompt ids and 24 greedy ids equal transformers' Gemma4Processor +
generate with images of two aspect ratios, in kv and hybrid modes; the hub's config form gives the same shapes;
a checkpoint with an audio tower loads its vision and text; with bidirectional attention over images
(use_bidirectional_attention "vision", exported with blocks of 32 that would split an image) the ids equal generate
too, and a follow-up turn reuses the first turn's rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

PROMPT = "Describe the picture."
SIZES = [(37, 90), (120, 41)]  # (height, width): wide and tall


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from family_cases import GEMMA4_CASES, gemma4_exported

    return gemma4_exported(GEMMA4_CASES[0], tmp_path_factory)  # (the shared runner's export)


def image(size, seed):
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8))


def test_images_of_two_aspect_ratios_equal_generate(bundle, capsys):
    """Two images (wide, tall: 20 and 18 soft tokens, each between <boi> and <eoi>) and text in one turn: the prompt
    ids transformers' processor makes and its 24 greedy ids, in both modes (prefill blocks of 16 split both images)."""
    from family_runner import cli_json
    from fixtures_gemma4 import hf_generate, hf_model, hf_processor

    images = [image(s, k) for k, s in enumerate(SIZES)]
    ids, want = hf_generate(hf_model(bundle.ckpt), hf_processor(bundle.ckpt), images, PROMPT, 24)
    assert len(set(want)) > 3
    paths = []
    for k, im in enumerate(images):
        paths += ["--image", str(bundle.tmp / f"im{k}.png")]
        im.save(paths[-1])
    for mode in ("kv", "hybrid"):
        got = cli_json(capsys, bundle.bundle, *paths, "--prompt", PROMPT, "--mode", mode, "--max-new-tokens", 24,
                       "--ignore-eos")
        assert got["prompt_tokens"] == len(ids) and got["token_ids"] == want, mode


def test_manifest_rows_are_wider_than_hidden(bundle):
    """The token table, the vision graph's rows and the decoder's inputs are hidden + layers × per_layer wide."""
    from fixtures_gemma4 import TEXT

    m = bundle.manifest()
    width = TEXT["hidden_size"] + TEXT["num_hidden_layers"] * TEXT["hidden_size_per_layer_input"]
    assert m["decoder"]["hidden_size"] == width
    assert np.load(bundle.bundle / "embed.npy", mmap_mode="r").shape[1] == width
    assert [layer["kind"] for layer in m["kv"]["layers"]] == ["windowed_attention", "windowed_attention", "attention",
                                                              "windowed_attention", "shared_kv", "shared_kv"]
    # (a windowed cache of window + the prefill block's rows: the CPU graph's GroupQueryAttention evicts itself)
    assert m["kv"]["layers"][0]["capacity"] == m["kv"]["layers"][0]["window"] + m["decoder"]["prefill_ar"]


def test_hub_config_form_gives_the_same_family_config(bundle):
    """The hub writes global_head_dim / num_global_key_value_heads where transformers' save writes per_layer_config:
    both give the same layer shapes."""
    from fixtures_gemma4 import TEXT
    from vlmrt.families import family_for

    saved = json.loads((bundle.ckpt / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    hub = json.loads(json.dumps(saved))
    del hub["text_config"]["per_layer_config"]
    hub["text_config"].update(global_head_dim=TEXT["global_head_dim"],
                              num_global_key_value_heads=TEXT["num_global_key_value_heads"])
    fam = family_for(saved)
    assert fam.config(hub).text.shapes == fam.config(saved).text.shapes
    assert {s.head_dim for s in fam.config(saved).text.shapes} == {16, 32}


@pytest.fixture(scope="module")
def bidirectional(tmp_path_factory):
    """The test checkpoint with use_bidirectional_attention "vision" (the same weights), exported with prefill
    blocks of 32: (checkpoint, bundle), once per session (family_cases; test_web_gemma4.py takes it too)."""
    from family_cases import gemma4_bidirectional_exported

    return gemma4_bidirectional_exported(tmp_path_factory)


def _hf_chat(ckpt, images, messages, n):
    """(prompt ids, greedy new ids) of transformers' Gemma4Processor + generate on a conversation (EOS ignored)."""
    import copy

    import torch

    from fixtures_gemma4 import hf_model, hf_processor

    model, processor = hf_model(ckpt), hf_processor(ckpt)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=cfg, do_sample=False, max_new_tokens=n)
    k = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, k:].tolist()


def test_bidirectional_vision_attention_equals_generate(bundle, bidirectional, tmp_path):
    """use_bidirectional_attention "vision" (an image token sees its whole image on the sliding layers during
    prefill): the manifest names the span input; with a wide and a tall image where a plain block of 32 would split
    the second, 24 greedy ids equal Gemma4Processor + generate in both modes (the blocks cut at the image: the
    answer differs from the causal export's), and a follow-up turn reusing the first turn's rows equals generate on
    the whole conversation."""
    from vlmrt.runtime.vlm import VLM

    ckpt, b = bidirectional
    m = json.loads((b / "manifest.json").read_text())
    assert m["decoder"]["span_input"] == "span_ids"
    # (the sliding layers in a windowed cache: its graph's span nodes read the buffers before the step)
    assert {layer["kind"] for layer in m["kv"]["layers"]} == {"windowed_attention", "attention", "shared_kv"}
    images = [image(s, k) for k, s in enumerate(SIZES)]
    paths = []
    for k, im in enumerate(images):
        paths.append(str(tmp_path / f"im{k}.png"))
        im.save(paths[-1])
    user = {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPT}]}
    ids, want = _hf_chat(ckpt, images, [user], 24)
    image_id = json.loads((ckpt / "config.json").read_text())["image_token_id"]
    at = [i for i, t in enumerate(ids) if t == image_id]
    assert at[0] < 32 <= at[-1] and 31 in at and 32 in at  # (a block of 32 ends inside the second image)
    vlm = VLM.load(b)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}} for p in paths]
             + [{"type": "text", "text": PROMPT}]}]
    for mode in ("kv", "hybrid"):
        vlm.reset()
        "".join(vlm.chat(msgs, mode=mode, max_new_tokens=24, ignore_eos=True))
        assert vlm.result.prompt_ids == ids and vlm.result.token_ids == want, mode
    causal = VLM.load(bundle.bundle)  # the causal export of the same weights answers otherwise
    "".join(causal.chat(msgs, max_new_tokens=24, ignore_eos=True))
    assert causal.result.token_ids != want
    answer = vlm.result.text
    follow = "And the shapes?"
    ids2, want2 = _hf_chat(ckpt, images, [user, {"role": "assistant", "content": answer},
                                          {"role": "user", "content": follow}], 24)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
    "".join(vlm.chat(msgs, max_new_tokens=24, ignore_eos=True))
    assert vlm.result.prompt_ids == ids2 and vlm.result.token_ids == want2
    first_end = next(i for i in at if i + 1 not in at) + 1
    assert vlm.result.stats.reused_prompt_tokens >= first_end  # (the first image's rows kept, not run again)


def test_bidirectional_static_graphs_hold_each_image_in_one_block(bidirectional, tmp_path, capsys):
    """Static decoder graphs (`--attention portable --context-step 0`: the HTP target's rows_static kind, float, on
    the CPU EP) of the "vision" bidirectional checkpoint: the prefill graph's AR is raised to an image's 70 rows (a
    block holds the whole of every image it starts: blocks end before an image and the image's block is padded), an
    AR below it is refused in one line; with text before two images, where a plain block of 70 would end inside the
    first, the prompt ids and 24 greedy ids equal Gemma4Processor + generate in kv mode (each image one prefill-graph
    call) and hybrid mode. On main ef8b8dc such an export was refused."""
    from vlmrt import cli
    from vlmrt.export.pipeline import export
    from vlmrt.runtime.vlm import VLM

    ckpt, _ = bidirectional
    assert cli.main(["export", str(ckpt), str(tmp_path / "refused"), "--attention", "portable", "--context-step", "0",
                     "--prefill-ar", "32", "--max-seq-len", "256"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "--prefill-ar 70 or more" in err[-1] and "Traceback" not in "".join(err)
    assert not (tmp_path / "refused").exists()
    b = export(str(ckpt), tmp_path / "static", attention="portable", context_step=0, max_seq_len=256, progress=False)
    m = json.loads((b / "manifest.json").read_text())
    assert m["decoder"]["kind"]["name"] == "rows_static" and m["decoder"]["prefill_ar"] == 70
    assert m["decoder"]["span_input"] == "span_ids"
    images = [image(s, k) for k, s in enumerate(SIZES)]
    paths = []
    for k, im in enumerate(images):
        paths.append(str(tmp_path / f"im{k}.png"))
        im.save(paths[-1])
    before = "Look closely at these: "
    user = {"role": "user", "content": [{"type": "text", "text": before}, {"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": PROMPT}]}
    ids, want = _hf_chat(ckpt, images, [user], 24)
    image_id = json.loads((ckpt / "config.json").read_text())["image_token_id"]
    at = [i for i, t in enumerate(ids) if t == image_id]
    assert at[0] < 70 <= at[-1] and 69 in at and 70 in at  # (a block of 70 from 0 ends inside an image)
    vlm = VLM.load(b)
    msgs = [{"role": "user", "content": [{"type": "text", "text": before}]
             + [{"type": "image_url", "image_url": {"url": p}} for p in paths] + [{"type": "text", "text": PROMPT}]}]
    for mode in ("kv", "hybrid"):
        vlm.reset()
        "".join(vlm.chat(msgs, mode=mode, max_new_tokens=24, ignore_eos=True))
        assert vlm.result.prompt_ids == ids and vlm.result.token_ids == want, mode


def test_weight_only_precision_splits_the_table(bundle):
    """A weight-only precision quantizes the graphs and, when a row carries per-layer rows, splits the token table
    by default: the embedding columns float16, the per-layer columns 4-bit in groups of 32 (whole int8 / 4-bit rows
    cost answers on random weights, the per-layer columns alone little: docs/gemma4.md, "The token table's stored
    forms"); an fp32 export keeps float32, fp16 graphs float16; `--table` names another form (Plan.table_form, on
    this checkpoint's config). On main 27f8984 the weight-only default was float16. The export itself:
    test_split_table_is_read_as_the_export_wrote_it."""
    from types import SimpleNamespace

    from vlmrt.export.pipeline import Plan
    from vlmrt.families import family_for
    from vlmrt.families.checkpoint import Checkpoint

    ckpt = Checkpoint.open(bundle.ckpt)
    cfg = family_for(ckpt.config).config(ckpt.config)
    assert cfg.text.row_width > cfg.text.hidden

    def form(quant, table=None):
        plan = SimpleNamespace(table=table, prec={"prefill": quant, "decode": quant}, head=None, dtype="fp32", cfg=cfg)
        return Plan.table_form.fget(plan)

    assert (form("w8a16"), form("w4a8"), form("fp32"), form("fp16"), form("w4a8", "int8g64")) == (
        "float16+int4g32", "float16+int4g32", "float32", "float16", "int8g64")


def test_split_table_is_read_as_the_export_wrote_it(bundle, tmp_path, capsys):
    """`--quant w8a16` (the default table there: float16+int4g32, runtime/table_rows.py): the manifest names the
    parts (the hidden embedding columns float16, the per-layer columns int4 in groups of 32) and no scale file, and
    reads back as written (save -> load: the same DecoderSpec); embed.npy is one uint8 row of 2·hidden + per-layer / 2
    + 2·⌈per-layer / 32⌉ bytes a token, byte for byte table_rows.pack of the fp32 bundle's table (the same TokenTable
    rows); the runtime's rows (Bundle.open: one pread a row) are the float16 embedding beside table_rows.dequantize of
    the per-layer columns' int4g32 codes, bit for bit, by ids and one row at a time; the bundle answers 24 tokens.
    A manifest whose parts do not sum to the row, or name a part's form the runtime has not, is refused in one line;
    `--table float16+int3` is refused in one line before anything is read, and a split form on a family without
    per-layer rows (SmolVLM's) in one line, nothing written. On main 27f8984 the split form was no --table choice and
    a manifest's embedding_parts an unknown field."""
    import dataclasses

    from vlmrt import cli
    from family_runner import cli_json
    from fixtures import make_smolvlm_checkpoint
    from vlmrt.format import manifest as mf
    from vlmrt.runtime import table_rows
    from vlmrt.runtime.bundle import Bundle

    out = tmp_path / "split"
    assert cli.main(["export", str(bundle.ckpt), str(out), "--quant", "w8a16", "--quiet"]) == 0
    m = mf.load(out)
    d, fp32 = m.decoder, np.load(bundle.bundle / "embed.npy")
    hidden, width = d.embedding_parts[0].columns, fp32.shape[1]
    assert (d.embedding_dtype, d.embedding_group, d.embedding_scale_file) == ("parts", None, None)
    assert d.embedding_parts == [mf.TablePart(hidden, "float16", None), mf.TablePart(width - hidden, "int4", 32)]
    assert not d.kind.token_rows_input and 0 < hidden < width
    mf.save(m, tmp_path)
    assert mf.load(tmp_path, verify=False).decoder == d
    stored = np.load(out / "embed.npy")
    parts = [("float16", hidden), ("int4g32", width - hidden)]
    per = width - hidden
    assert stored.dtype == np.uint8 and stored.shape == (fp32.shape[0], 2 * hidden + per // 2 + 2 * -(-per // 32))
    assert np.array_equal(stored, table_rows.pack(fp32, parts))
    q, s = table_rows.quantize(fp32[:, hidden:], "int4g32")
    rows = np.concatenate([fp32[:, :hidden].astype(np.float16).astype(np.float32),
                           table_rows.dequantize(q, s, "int4g32", per)], axis=1)
    b = Bundle.open(out)
    ids = np.arange(fp32.shape[0])
    assert b.embed_scale is None and np.array_equal(b.embed_table[ids], rows)
    assert all(np.array_equal(b.embed_table.row(int(t)), rows[t]) for t in (0, 7, len(ids) - 1))
    got = cli_json(capsys, out, "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos")
    assert len(got["token_ids"]) == 24

    for bad, says in [([mf.TablePart(hidden, "float16"), mf.TablePart(per - 1, "int4", 32)], "sum to"),
                      ([mf.TablePart(hidden, "float16"), mf.TablePart(per, "int4", 16)], "embedding_parts[1]")]:
        mf.save(dataclasses.replace(m, decoder=dataclasses.replace(d, embedding_parts=bad)), tmp_path)
        with pytest.raises(mf.BundleError) as e:
            mf.load(tmp_path, verify=False)
        assert says in str(e.value) and "\n" not in str(e.value)

    smol = make_smolvlm_checkpoint(tmp_path / "smol")
    capsys.readouterr()
    assert cli.main(["export", str(bundle.ckpt), str(tmp_path / "bad"), "--table", "float16+int3"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown --table 'float16+int3'" in err and "float16+int4g32" in err
    assert cli.main(["export", str(smol), str(tmp_path / "bad"), "--table", "float16+int4g32", "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "per-layer columns" in err and "int4g32" in err
    assert not (tmp_path / "bad").exists()


def test_table_in_4bit_row_groups_is_read_as_the_export_wrote_it(bundle, tmp_path, capsys):
    """`--quant w8a16 --table int4g32` (runtime/table_rows.py): the manifest names the form (int4, groups of 32, a
    scale file) and the graph takes no int8 token rows; embed.npy / embed_scale.npy are table_rows.quantize of the
    fp32 bundle's table (the same TokenTable rows), byte for byte; the runtime's rows (Bundle.open: codes and scales
    read per row) are table_rows.dequantize of those files, bit for bit, by ids and one row at a time; each value is
    within half its group's scale of the float32 value (numpy's rounding: no CPU-dependent margin), and within 0.08
    of its row's largest magnitude of the float16 table's value (measured 0.072 here); the bundle answers 24
    tokens. An unknown form is refused in one line before anything is read. On main ef8b8dc `--table` is no
    option (and the w8a16 export wrote the float16 table: the guard of test_weight_only_precision_splits_the_table
    before it)."""
    from vlmrt import cli
    from family_runner import cli_json
    from vlmrt.runtime import table_rows
    from vlmrt.runtime.bundle import Bundle

    out = tmp_path / "int4g32"
    assert cli.main(["export", str(bundle.ckpt), str(out), "--quant", "w8a16", "--table", "int4g32", "--quiet"]) == 0
    d = json.loads((out / "manifest.json").read_text())["decoder"]
    assert (d["embedding_dtype"], d["embedding_group"], d["embedding_scale_file"]) == ("int4", 32, "embed_scale.npy")
    assert not d["kind"].get("token_rows_input")
    fp32 = np.load(bundle.bundle / "embed.npy")
    codes, scales = np.load(out / "embed.npy"), np.load(out / "embed_scale.npy")
    q, s = table_rows.quantize(fp32, "int4g32")
    assert codes.dtype == np.uint8 and scales.dtype == np.float16
    assert np.array_equal(codes, q) and np.array_equal(scales, s)
    rows = table_rows.dequantize(codes, scales, "int4g32", fp32.shape[1])
    b = Bundle.open(out)
    ids = np.arange(fp32.shape[0])
    assert b.embed_scale is None and np.array_equal(b.embed_table[ids], rows)
    assert all(np.array_equal(b.embed_table.row(int(t)), rows[t]) for t in (0, 7, len(ids) - 1))
    half = np.repeat(scales.astype(np.float32), 32, axis=1)[:, :fp32.shape[1]] / 2
    assert (np.abs(rows - fp32) <= half).all()
    f16 = fp32.astype(np.float16).astype(np.float32)[1:]  # (row 0, the pad token's, is zeros)
    assert (np.abs(rows[1:] - f16).max(1) / np.abs(f16).max(1)).max() < 0.08
    got = cli_json(capsys, out, "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos")
    assert len(got["token_ids"]) == 24

    capsys.readouterr()
    assert cli.main(["export", str(bundle.ckpt), str(tmp_path / "bad"), "--table", "int3"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown --table 'int3'" in err and "int4g32" in err
    assert not (tmp_path / "bad").exists()


def test_audio_tower_checkpoint_loads_vision_and_text(tmp_path):
    """A checkpoint with an audio tower: its audio weights are left out, its vision and text load as the contract
    checks them (every other weight mapped)."""
    from safetensors.torch import load_file

    from fixtures_gemma4 import make_gemma4_checkpoint
    from vlmrt.families import family_for

    ckpt = make_gemma4_checkpoint(tmp_path / "audio", audio=True)
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert any(k.startswith("model.audio_tower.") for k in tensors)
    fam = family_for(config)
    cfg = fam.config(config)
    assert cfg.audio
    from vlmrt.families.checkpoint import Checkpoint

    fam.host(Checkpoint.open(ckpt), cfg, json.loads((ckpt / "tokenizer.json").read_text()))
    weights = fam.weights(cfg, tensors)
    assert weights.embed.shape[1] == cfg.text.row_width


def test_bidirectional_video_frames_are_spans(bundle, bidirectional, capsys):
    """A video on the "vision" bidirectional export: transformers counts video tokens as vision, so each frame's run
    of <|video|> rows (68, longer than the blocks of 32, with "<eoi> MM:SS <boi>" between frames) sees itself both
    ways on the sliding layers; vlmrt's frames are image chunks, so spans of their own: `--video --max-frames 2` gives
    Gemma4Processor (num_frames 2) + generate's prompt ids and 24 greedy ids in both modes (the causal export's
    differ)."""
    from transformers.video_utils import VideoMetadata

    import oracle
    from conftest import ASSETS
    from family_runner import cli_json
    from fixtures_gemma4 import hf_model, hf_processor
    from vlmrt.runtime.media import video as V

    ckpt, b = bidirectional
    gif = ASSETS / "no_time_for_that_tiny.gif"
    clip = V.read_video(gif)
    frames = np.stack([np.asarray(f) for f in clip.frames(np.arange(clip.total_frames))])
    proc = hf_processor(ckpt)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}],
                                    add_generation_prompt=True, tokenize=False)
    meta = VideoMetadata(total_num_frames=clip.total_frames, fps=clip.fps, duration=clip.duration)
    inputs = proc(text=[text], videos=[frames], video_metadata=[meta], num_frames=2, return_tensors="pt")
    types = inputs["mm_token_type_ids"][0].numpy()
    runs = np.flatnonzero(np.diff(np.concatenate([[0], types == 2, [0]]).astype(int)) == 1)
    assert len(runs) == 2 and (types == 2).sum() > 2 * 32  # (two frame spans, each longer than a block)
    want = oracle.greedy_new_ids(hf_model(ckpt), inputs, 24, ignore_eos=True)
    args = ["--video", gif, "--max-frames", 2, "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos"]
    for mode in ("kv", "hybrid"):
        got = cli_json(capsys, b, *args, "--mode", mode)
        assert got["prompt_tokens"] == inputs["input_ids"].shape[1] and got["token_ids"] == want, mode
    assert cli_json(capsys, bundle.bundle, *args)["token_ids"] != want


def edge_images(folder):
    """Images at sizes and in modes the other tests do not cover: (name, path)."""
    from PIL import Image

    rng = np.random.default_rng(7)

    def noise(h, w, c=3):
        return (rng.random((h, w, c)) * 255).astype(np.uint8)

    out = []

    def save(name, im, **kw):
        path = folder / name
        im.save(path, **kw)
        out.append((name, path))

    save("one-pixel.png", Image.fromarray(noise(1, 1)))
    save("one-pixel-wide.png", Image.fromarray(noise(300, 1)))
    save("one-pixel-high.png", Image.fromarray(noise(1, 500)))
    save("huge.jpg", Image.fromarray(noise(2000, 3000)), quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to show
    save("exif-rotated.jpg", Image.fromarray(noise(40, 90)), exif=exif.tobytes())
    rgba = noise(50, 70, 4)
    rgba[..., 3] = np.linspace(0, 255, 70, dtype=np.uint8)[None, :]
    save("rgba.png", Image.fromarray(rgba, "RGBA"))
    save("grey.png", Image.fromarray(noise(33, 61, 1)[..., 0], "L"))
    save("grey-alpha.png", Image.fromarray(noise(45, 30, 2), "LA"))
    pal = Image.fromarray(noise(64, 48)).quantize(16)
    save("palette-transparent.png", pal, transparency=3)
    save("grey-16bit.png", Image.fromarray((rng.random((20, 37)) * 65535).astype(np.uint16)))
    return out


def test_image_edge_cases_give_the_processors_patches(bundle, tmp_path):
    """Images at sizes and modes not covered elsewhere (1×1, 1 px wide / high, 3000×2000, EXIF-rotated, RGBA,
    greyscale, greyscale + alpha, a palette with a transparent index, 16-bit greyscale): vlmrt's patch rows and prompt
    ids equal Gemma4Processor's on the same file opened as transformers' load_image opens it (EXIF orientation
    applied; the processor composites transparency onto white, as vlmrt does) to 1e-6."""
    from PIL import Image, ImageOps

    from fixtures_gemma4 import hf_processor
    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(bundle.bundle)
    proc = hf_processor(bundle.ckpt)
    for name, path in edge_images(tmp_path):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                             {"type": "text", "text": PROMPT}]}]
        p = vlm.prompt(msgs)
        im = ImageOps.exif_transpose(Image.open(path))
        text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
                                        add_generation_prompt=True, tokenize=False)
        want = proc(text=[text], images=[[im]], return_tensors="pt")
        assert p.ids == want["input_ids"][0].tolist(), name
        got = p.images()[0][1].pixels[0]
        np.testing.assert_allclose(got, want["pixel_values"][0].numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_token_table_is_read_from_the_checkpoint_in_row_blocks(bundle, tmp_path, monkeypatch):
    """Export memory (issue 45): the token table [vocab, hidden + layers × per_layer] (11 GB as float32 at E2B) is
    never whole in memory. The loader gives it as row blocks of the checkpoint's own tensors (safetensors' map: the
    same storage, not a float32 copy), bit-equal to the table computed whole; the exporter writes embed.npy a block
    at a time (at most a quarter of the rows here), byte-equal to np.save of the whole table, float16 and int8 rows +
    scales alike, and the split form's rows of bytes (table_rows.pack of the whole table), and a large table's write allocates under a tenth of the file (tracemalloc). On main f2d6421 the
    loader built the float32 table whole (torch.cat) and the export converted it whole (np.save(embed.astype(...))."""
    import tracemalloc
    from types import SimpleNamespace

    import torch

    from vlmrt.export import graphs, pipeline
    from vlmrt.export.cpu import quantize
    from vlmrt.families import family_for, token_table
    from vlmrt.families.checkpoint import Checkpoint
    from vlmrt.progress import Progress
    from vlmrt.runtime import table_rows

    ckpt = Checkpoint.open(bundle.ckpt)
    fam = family_for(ckpt.config)
    cfg = fam.config(ckpt.config)
    fam.host(ckpt, cfg, json.loads((bundle.ckpt / "tokenizer.json").read_text()))
    tensors = ckpt.tensors()
    table = fam.weights(cfg, tensors).embed
    t = cfg.text
    names = ["model.language_model.embed_tokens.weight", "model.language_model.embed_tokens_per_layer.weight"]
    assert [s.data_ptr() for s, _ in table.parts] == [tensors[n].data_ptr() for n in names]
    whole = torch.cat([tensors[names[0]].float() * torch.tensor(t.hidden ** 0.5),
                       tensors[names[1]].float() * torch.tensor(t.per_layer ** 0.5)], dim=1).numpy()
    assert table.shape == whole.shape and np.array_equal(table.rows(0, t.vocab), whole)
    assert np.array_equal(table[[3, 0, 3]], whole[[3, 0, 3]])
    assert np.array_equal(np.load(bundle.bundle / "embed.npy"), whole)  # (the fp32 export)

    sizes = []
    rows = token_table.TokenTable.rows
    monkeypatch.setattr(token_table.TokenTable, "rows", lambda self, a, b: sizes.append(b - a) or rows(self, a, b))
    monkeypatch.setattr(token_table, "BLOCK_BYTES", 4 * t.row_width * (t.vocab // 4))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")

    def write(form: str, table, folder):
        folder.mkdir()
        plan = SimpleNamespace(table_form=form, ckpt=SimpleNamespace(path=tmp_path / "ckpt"), cfg=cfg)
        return pipeline._write_host_files(plan, table, folder, Progress(1, False))

    assert write("float16", table, tmp_path / "f16") == ("float16", None)
    assert (tmp_path / "f16" / "embed.npy").read_bytes() == _npy(whole.astype(np.float16))
    assert write("int8", table, tmp_path / "i8") == ("int8", "embed_scale.npy")
    q, scale = quantize.int8_rows(whole)
    assert (tmp_path / "i8" / "embed.npy").read_bytes() == _npy(q)
    assert (tmp_path / "i8" / "embed_scale.npy").read_bytes() == _npy(scale)
    for form in ("int4g32", "int8g64"):  # the grouped forms: codes and float16 scales a block at a time
        assert write(form, table, tmp_path / form) == (form, "embed_scale.npy")
        q, scale = table_rows.quantize(whole, form)
        assert (tmp_path / form / "embed.npy").read_bytes() == _npy(q)
        assert (tmp_path / form / "embed_scale.npy").read_bytes() == _npy(scale)
    assert write("float16+int4g32", table, tmp_path / "split") == ("float16+int4g32", None)  # rows of bytes
    parts = table_rows.parts_of("float16+int4g32", t.hidden, t.row_width)
    assert (tmp_path / "split" / "embed.npy").read_bytes() == _npy(table_rows.pack(whole, parts))
    assert max(sizes) <= t.vocab // 4 and sum(sizes) == 5 * t.vocab
    npy = tmp_path / "i8" / "embed.npy"  # share_weights' key of a table file, read a chunk at a time
    arr, offset = np.load(npy), np.load(npy, mmap_mode="r").offset
    assert graphs.npy_tensors(tmp_path / "i8", ["embed.npy"]) == {
        graphs._content_key(arr.tobytes(), onnx_dtype(arr.dtype), arr.shape): ("embed.npy", offset, arr.nbytes)}

    big = token_table.TokenTable([(torch.ones(16384, 1024, dtype=torch.bfloat16), 2.0)], 16384)  # 32 MB as float16
    monkeypatch.setattr(token_table, "BLOCK_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        write("float16", big, tmp_path / "big")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (tmp_path / "big" / "embed.npy").stat().st_size > 32 << 20 and peak < (32 << 20) // 10, peak


def _npy(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def onnx_dtype(dtype) -> int:
    import onnx

    return onnx.helper.np_dtype_to_tensor_dtype(dtype)
