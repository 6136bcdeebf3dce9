"""LFM2-VL against transformers on tiny random checkpoints (tests/fixtures_lfm2_vl.py): the vision graph (SigLIP2
NaFlex + projector, host-made position weights and key mask: runtime/media/naflex.py) per tile of many sizes; the image text;
the exported bundles (tests/family_cases.py LFM2_CASES, which test_family_conformance.py holds to generate in every
decoder kind) with images of different sizes in one prompt, lookahead rejections and a follow-up turn's prefix reuse
leaving the conv and K/V rows plain decoding's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.media import naflex

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
torch = pytest.importorskip("torch")

# image sizes (w, h) at the fixture's settings (64² tiles of 8 px patches, 4..16 tokens per image): one tile rounded
# up, one rounded down, tall and wide single images, grids of 2..6 tiles with their thumbnails
SIZES = [(150, 220), (40, 40), (300, 90), (13, 200), (64, 64), (96, 40), (250, 250)]
MASK = float(np.finfo(np.float32).min)  # transformers' eager attention masks padding keys with the dtype's lowest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from fixtures_lfm2_vl import make_lfm2_vl_checkpoint

    return make_lfm2_vl_checkpoint(tmp_path_factory.mktemp("lfm2vl") / "ckpt")


@pytest.fixture(scope="module")
def hf(ckpt):
    from fixtures_lfm2_vl import hf_model, hf_processor

    return hf_model(ckpt), hf_processor(ckpt)


@pytest.fixture(scope="module")
def vision(ckpt):
    from safetensors.torch import load_file

    from vlmrt.families import lfm2_vl

    cfg = lfm2_vl.config_from_hf(json.loads((ckpt / "config.json").read_text()))
    cfg.max_patches = json.loads((ckpt / "preprocessor_config.json").read_text())["max_num_patches"]
    tensors = load_file(str(ckpt / "model.safetensors"))
    return cfg, lfm2_vl.load_vision(cfg, lambda n: tensors[n].float())


def tiles_of(size, seed=0):
    w, h = size
    x = np.random.default_rng(seed + w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(x)


def reference_features(hf, im) -> tuple[dict, list[np.ndarray]]:
    """The processor's tensors and transformers' projected image features, one array per tile."""
    model, proc = hf
    inp = proc.image_processor(images=[im], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=inp["pixel_values"], spatial_shapes=inp["spatial_shapes"],
                                             pixel_attention_mask=inp["pixel_attention_mask"]).pooler_output
    return inp, [o.numpy() for o in out]


def test_vision_module_equals_transformers(hf, vision):
    """Our torch vision module, fed what the host makes of the processor's tiles (token-major rows, position weights,
    key mask), gives transformers' features tile by tile to float32 rounding (measured: 1.8e-6 of values ~2.5)."""
    cfg, vis = vision
    tiles = 0
    for size in SIZES:
        inp, ref = reference_features(hf, tiles_of(size))
        for k, want in enumerate(ref):
            x, pw, mask, n = naflex.tile_inputs(inp["pixel_values"][k].numpy(), inp["spatial_shapes"][k].numpy(),
                                                cfg.vision.position_side, cfg.downsample_factor, MASK)
            assert n == len(want)
            with torch.no_grad():
                got = vis(torch.from_numpy(x), torch.from_numpy(pw), torch.from_numpy(mask))[:n].numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=5e-6, err_msg=f"{size} tile {k}")
            tiles += 1
    assert tiles > 2 * len(SIZES)


def test_vision_graph_equals_transformers(ckpt, hf, vision, tmp_path):
    """The exported static vision graph (ONNX Runtime, fp32) from vlmrt's own preprocessing of the image: the same
    features for tiles of every size through the one graph."""
    import onnxruntime as ort

    from fixtures_lfm2_vl import image_spec
    from vlmrt.export.graphs import export_graph

    cfg, vis = vision
    P, d = cfg.max_patches, 3 * cfg.vision.patch_size**2
    args = (torch.zeros(P, d), torch.zeros(P, cfg.vision.position_side**2), torch.zeros(P))
    path = tmp_path / "vision.onnx"
    export_graph(vis, args, ["patches", "position_weights", "patch_mask"], ["image_embeds"], path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    spec = image_spec(json.loads((ckpt / "preprocessor_config.json").read_text()))
    for size in SIZES:
        im = tiles_of(size)
        _, ref = reference_features(hf, im)
        tiles = img_ops.preprocess(im, spec)
        assert len(tiles.pixels) == len(ref)
        for k, want in enumerate(ref):
            x, pw, mask, n = naflex.tile_inputs(tiles.pixels[k], tiles.patch_grids[k], cfg.vision.position_side,
                                                cfg.downsample_factor, MASK)
            got = sess.run(None, {"patches": x, "position_weights": pw, "patch_mask": mask})[0][:n]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{size} tile {k}")


def test_prompt_markers_equal_processor(ckpt, hf):
    """The image text (runtime/prompt/build.py tile_markers: start/end, <|img_row_R_col_C|> per tile, <|img_thumbnail|>,
    the image-token runs) from vlmrt's own tiling, tokenized, equals the processor's input ids for one user turn with
    single and tiled images, and two images in one turn."""
    from tokenizers import Tokenizer

    from fixtures_lfm2_vl import IMAGE, IMAGE_END, IMAGE_START, THUMBNAIL, hf_inputs, image_spec
    from vlmrt.format.manifest import PromptSpec
    from vlmrt.runtime.prompt.build import tile_markers

    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    spec = image_spec(pre)
    p = PromptSpec(chat_template="", expansion="tile_markers", tokens_per_tile=16, add_special_tokens=False,
                   image_placeholder=IMAGE, params={"image_token": IMAGE, "start_token": IMAGE_START,
                                                     "end_token": IMAGE_END, "thumbnail_token": THUMBNAIL,
                                                     "tile_marker": "<|img_row_{row}_col_{col}|>"})
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    grids = 0
    for images in [[tiles_of(s)] for s in SIZES] + [[tiles_of((300, 90)), tiles_of((40, 40))]]:
        want = hf_inputs(hf[1], images, PROMPT)["input_ids"][0].tolist()
        text = hf[1].apply_chat_template([{"role": "user", "content": [{"type": "image"} for _ in images] +
                                           [{"type": "text", "text": PROMPT}]}], add_generation_prompt=True, tokenize=False)
        head, *rest = text.split(IMAGE)
        for im, piece in zip(images, rest):
            t = img_ops.preprocess(im, spec)
            grids += t.rows > 0
            head += tile_markers(t.rows, t.cols, naflex.tile_tokens(t.patch_grids, pre["downsample_factor"]), p) + piece
        assert tok.encode(head, add_special_tokens=False).ids == want
    assert grids >= 4


# --- the decoder through the runtime: conv rows per slot beside the K/V rows (family_cases.LFM2_CASES' bundles) ----
# (24 greedy ids = generate in kv and hybrid modes per layer pattern and decoder kind: test_family_conformance.py)

PROMPT = "What is in the image? Describe the colours."


def lfm2_cases():
    from family_cases import LFM2_CASES

    return LFM2_CASES


@pytest.fixture(scope="module", params=range(2), ids=["gqa_in_place", "rows_dynamic"])
def bundle(request, tmp_path_factory):
    from family_cases import LFM2_CASES, lfm2_exported

    return lfm2_exported(LFM2_CASES[request.param], tmp_path_factory)


def state(vlm) -> list[np.ndarray]:
    """Every K/V row and conv row the cache holds (slots 0..length-1)."""
    c = vlm.row.cache
    return [c.stored()] + [x.data[x.spec.width:x.spec.width + c.length] for x in c.states["conv"].rows]


def assert_same_state(a, b, atol=2e-5):
    assert a.row.cache.length == b.row.cache.length
    for x, y in zip(state(a), state(b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def test_images_of_different_sizes_in_one_prompt_equal_generate(bundle, capsys):
    """A tiled image (tiles and a thumbnail of other token counts) and a single one in one turn: the prompt ids and
    24 greedy ids of transformers, in both modes."""
    from fixtures_lfm2_vl import hf_generate
    from family_runner import cli_json

    model, proc = bundle.hf()
    images = [tiles_of((150, 220)), tiles_of((40, 40))]
    ids, want = hf_generate(model, proc, images, PROMPT, 24)
    paths = []
    for k, im in enumerate(images):
        paths += ["--image", str(bundle.tmp / f"im{k}.png")]
        im.save(paths[-1])
    for mode in ("kv", "hybrid"):
        got = cli_json(capsys, bundle.bundle, *paths, "--prompt", PROMPT, "--mode", mode, "--max-new-tokens", 24,
                       "--ignore-eos")
        assert got["prompt_tokens"] == len(ids) and got["token_ids"] == want, mode


def test_lookahead_rejections_leave_plain_state(bundle, monkeypatch):
    """A lookahead run whose drafts are partly rejected (rows computed and never written) gives plain decoding's ids
    and leaves every K/V and conv row plain decoding's (to the float rounding of a batched step). The random model
    copies nothing from its prompt, so the drafter looks up its drafts in the prompt's ids followed by plain
    decoding's answer with every fourth token wrong (Scheduler.generate's prompt_ids: only drafting reads them)."""
    from vlmrt.runtime.decode import lookahead
    from vlmrt.runtime.vlm import VLM

    # 2-grams too (every 3-gram of the lookup that the answer meets ends just before a wrong token) and a short
    # back-off, so that the 24 steps verify several partly accepted blocks
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 1)
    im = str(bundle.tmp / "la.png")
    tiles_of((96, 40)).save(im)
    plain, fast = VLM.load(bundle.bundle), VLM.load(bundle.bundle, lookahead=3)
    p = fast.prompt(PROMPT, [im])
    embeds = fast.embed_prompt(p)
    for mode in ("kv", "hybrid"):
        want = plain(PROMPT, im, max_new_tokens=24, ignore_eos=True, mode=mode).token_ids
        vocab = fast.manifest.decoder.vocab_size
        lookup = p.ids + [(t + 1) % vocab if i % 4 == 3 else t for i, t in enumerate(want)]
        got = list(fast.scheduler.generate(embeds, mode=mode, max_new_tokens=24, ignore_eos=True, prompt_ids=lookup))
        g = fast.scheduler.last
        assert got == want and g.drafted_tokens > g.accepted_tokens > 0, (mode, g.drafted_tokens, g.accepted_tokens)
        assert_same_state(fast, plain)


def test_follow_up_turn_reuses_conv_rows(bundle):
    """Turn 2 of a chat keeps the common prefix of turn 1's slots (the image, the prompt; fewer than the cache holds
    when the answer re-tokenizes otherwise) and feeds the rest: its ids are transformers' on the whole conversation,
    and its cache (K/V and conv rows) is a fresh run's."""
    from vlmrt.runtime.vlm import VLM

    model, proc = bundle.hf()
    im = tiles_of((150, 220))
    path = str(bundle.tmp / "chat.png")
    im.save(path)
    vlm, fresh = VLM.load(bundle.bundle), VLM.load(bundle.bundle)
    turn1 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": path}},
                                          {"type": "text", "text": PROMPT}]}]
    answer = "".join(vlm.chat(turn1, max_new_tokens=16, ignore_eos=True))
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the shapes?"}]
    got = "".join(vlm.chat(turn2, max_new_tokens=12, ignore_eos=True))
    r = vlm.result
    assert r.stats.reused_prompt_tokens > 0 and r.stats.vision_skipped
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
          {"role": "assistant", "content": [{"type": "text", "text": answer}]},
          {"role": "user", "content": [{"type": "text", "text": "And the shapes?"}]}]
    text = proc.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[[im]], return_tensors="pt")
    assert r.prompt_ids == inputs["input_ids"][0].tolist()
    import oracle

    assert r.token_ids == oracle.greedy_new_ids(model, inputs, 12, ignore_eos=True)
    "".join(fresh.chat(turn2, max_new_tokens=12, ignore_eos=True))
    assert fresh.result.token_ids == r.token_ids and got == fresh.result.text
    assert_same_state(vlm, fresh)
