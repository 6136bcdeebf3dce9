"""LFM2-VL against transformers on tiny random checkpoints (tests/fixtures_lfm2_vl.py): the vision graph (SigLIP2
NaFlex + projector, host-made position weights and key mask: runtime/naflex.py) per tile of many sizes; the hybrid
conv + attention decoder, its conv state per slot beside the K/V rows (tests/lfm2_steps.py: the host's side), in several
layer patterns, fed in blocks that cut conv windows, with lookahead rejections and a follow-up turn's prefix reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vlmrt.runtime import image as img_ops
from vlmrt.runtime import naflex

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
    """The image text (runtime/prompt.py tile_markers: start/end, <|img_row_R_col_C|> per tile, <|img_thumbnail|>,
    the image-token runs) from vlmrt's own tiling, tokenized, equals the processor's input ids for one user turn with
    single and tiled images, and two images in one turn."""
    from tokenizers import Tokenizer

    from fixtures_lfm2_vl import IMAGE, IMAGE_END, IMAGE_START, THUMBNAIL, hf_inputs, image_spec
    from vlmrt.format.manifest import PromptSpec
    from vlmrt.runtime.prompt import tile_markers

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


# --- the decoder: conv state as per-slot rows (tests/lfm2_steps.py is the host until the runtime's cache kinds) -------

PATTERNS = {  # layer_types: two conv layers in a row and a conv layer last; attention first and last; conv with biases
    "conv-attn-conv-conv": dict(layer_types=("conv", "full_attention", "conv", "conv")),
    "attn-conv-conv-attn-conv": dict(layer_types=("full_attention", "conv", "conv", "full_attention", "conv"), seed=1),
    "conv-conv-attn-bias": dict(layer_types=("conv", "conv", "full_attention"), conv_bias=True, auto_adjust_ff=True,
                                intermediate=192, seed=2),
}
PROMPT = "What is in the image? Describe the colours."


class Decoded:
    """One pattern's checkpoint, transformers, our modules and a prompt's embeddings."""

    def __init__(self, folder, pattern: dict):
        from safetensors.torch import load_file

        from fixtures_lfm2_vl import hf_model, hf_processor, make_lfm2_vl_checkpoint
        from vlmrt.families import lfm2_vl
        from vlmrt.families.lfm2_vl import language

        self.ckpt = make_lfm2_vl_checkpoint(folder, **pattern)
        self.model, self.proc = hf_model(self.ckpt), hf_processor(self.ckpt)
        self.cfg = lfm2_vl.config_from_hf(json.loads((self.ckpt / "config.json").read_text()))
        self.cfg.max_patches = json.loads((self.ckpt / "preprocessor_config.json").read_text())["max_num_patches"]
        tensors = load_file(str(self.ckpt / "model.safetensors"))
        self.vision = lfm2_vl.load_vision(self.cfg, lambda n: tensors[n].float())
        self.decoder, embed = language.load(self.cfg.text, lambda n: tensors[n].float(), "model.language_model.", None)
        self.embed = embed.numpy()

    def run(self, logit_rows: bool = False):
        dec = self.decoder.with_options(copy_free=True, logit_rows=logit_rows, rope_positions=1024)

        def call(*args):
            with torch.no_grad():
                return [t.numpy() for t in dec(*(torch.from_numpy(a) for a in args))]

        return call

    def state(self):
        from lfm2_steps import SlotState

        t = self.cfg.text
        return SlotState(t.layer_types, t.hidden, t.kv_dim, 512, t.conv_kernel - 1)

    def embeds(self, ids: list[int], images: list) -> np.ndarray:
        """The prompt's embeddings: token rows, our vision module's rows over the image-token slots."""
        rows = []
        for im in images:
            inp = self.proc.image_processor(images=[im], return_tensors="np")
            for k in range(len(inp["pixel_values"])):
                x, pw, mask, n = naflex.tile_inputs(inp["pixel_values"][k], inp["spatial_shapes"][k],
                                                    self.cfg.vision.position_side, self.cfg.downsample_factor, MASK)
                with torch.no_grad():
                    rows.append(self.vision(torch.from_numpy(x), torch.from_numpy(pw), torch.from_numpy(mask))[:n].numpy())
        e = self.embed[ids].copy()
        slots = np.flatnonzero(np.asarray(ids) == self.cfg.image_token_id)
        if rows:
            e[slots] = np.concatenate(rows)
        assert len(slots) == sum(len(r) for r in rows)
        return e


_DECODED: dict[str, Decoded] = {}


def decoded_of(name: str, tmp_path_factory) -> Decoded:
    if name not in _DECODED:
        _DECODED[name] = Decoded(tmp_path_factory.mktemp("lfm2dec") / name, PATTERNS[name])
    return _DECODED[name]


@pytest.fixture(scope="module", params=list(PATTERNS), ids=list(PATTERNS))
def decoded(request, tmp_path_factory):
    return decoded_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The first pattern's (two conv layers in a row, a conv layer last): the state and graph tests use one."""
    return decoded_of(next(iter(PATTERNS)), tmp_path_factory)


def test_decoder_greedy_equals_generate(decoded):
    """24 greedy ids with an image (several tiles) equal transformers' generate, fed one row per step (kv mode) and in
    blocks of 5 and 2 rows (hybrid: every block boundary cuts a conv window of 2 rows)."""
    from fixtures_lfm2_vl import hf_generate
    from lfm2_steps import greedy

    im = tiles_of((150, 220))
    ids, want = hf_generate(decoded.model, decoded.proc, [im], PROMPT, 24)
    assert len(set(want)) > 4  # not degenerate
    e = decoded.embeds(ids, [im])
    for block in (1, 2):
        assert greedy(decoded.run(), decoded.state(), decoded.embed, e, 24, block=block) == want, block
    assert greedy(decoded.run(True), decoded.state(), decoded.embed, e, 24, block=5, logit_rows=True) == want


def test_lookahead_and_prefix_reuse_leave_plain_state(first):
    """A lookahead run (drafts partly wrong: rejected rows are computed and never written) and a follow-up turn that
    keeps the first turn's slots both give plain decoding's ids, and leave the state (every K/V and conv row) plain
    decoding's, to float rounding of a batched call."""
    from fixtures_lfm2_vl import hf_generate, hf_inputs
    from lfm2_steps import greedy, lookahead

    im = tiles_of((96, 40))
    ids, want = hf_generate(first.model, first.proc, [im], PROMPT, 24)
    e = first.embeds(ids, [im])
    plain = first.state()
    assert greedy(first.run(), plain, first.embed, e, 24, block=5) == want

    def drafts(got):  # the right next tokens, then a wrong one: accepted prefixes of 0..3 drafts, then a rejection
        right = want[len(got):len(got) + len(got) % 4]
        return right + [(want[len(got) + len(right)] + 1) % first.cfg.text.vocab] if len(got) + len(right) < 24 else right

    la = first.state()
    got, rejected = lookahead(first.run(True), la, first.embed, e, 24, drafts, block=5)
    assert got == want and rejected > 3
    # the state after the last emitted token's step: lookahead has not fed the last id yet, plain decoding neither
    assert la.length == plain.length
    for a, b in zip(la.buffers, plain.buffers):
        np.testing.assert_allclose(a[:la.length], b[:plain.length], rtol=0, atol=2e-5)

    # turn 2: the conversation so far + a new question; the kept slots are the common prefix of the token ids
    answer = first.proc.tokenizer.decode(want, skip_special_tokens=True)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": "And the shapes?"}]}]
    text = first.proc.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    inputs = first.proc(text=[text], images=[[im]], return_tensors="pt")
    ids2 = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = first.model.generate(**inputs, generation_config=_no_eos(first.model, 12))
    want2 = out[0, len(ids2):].tolist()
    cached = ids + want[:-1]  # the slots plain decoding filled: the prompt and every answer token but the last
    common = next(i for i, (a, b) in enumerate(zip(cached + [None], ids2)) if a != b)
    # the first turn's image and prompt are reused, and fewer slots than the state holds (the answer re-tokenizes
    # differently): a rolling conv state would have to be rewound here
    assert len(ids) <= common < len(cached)
    plain.length = common
    e2 = first.embeds(ids2, [im])
    assert greedy(first.run(), plain, first.embed, e2[common:], 12, block=5, start=common) == want2
    fresh = first.state()
    assert greedy(first.run(), fresh, first.embed, e2, 12, block=5) == want2
    for a, b in zip(plain.buffers, fresh.buffers):
        np.testing.assert_allclose(a[:fresh.length], b[:fresh.length], rtol=0, atol=2e-5)


def _no_eos(model, n: int):
    import copy

    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id, cfg.do_sample, cfg.max_new_tokens = None, False, n
    return cfg


def test_decoder_graph_equals_generate(first, tmp_path):
    """The exported decoder graph (ONNX Runtime, fp32; AR and cache length symbolic, conv windows [2, hidden]) gives
    transformers' 24 greedy ids in kv mode and in blocks of 5, through the per-slot state host."""
    import onnxruntime as ort

    from fixtures_lfm2_vl import hf_generate
    from lfm2_steps import greedy
    from vlmrt.export.graphs import CastIO, export_graph

    t, ar, max_context = first.cfg.text, 5, 512
    dec = first.decoder.with_options(copy_free=True, logit_rows=True, rope_positions=max_context + ar)
    ins, outs = dec.state_names()
    ctx, n = torch.export.Dim("ctx", min=2, max=max_context), torch.export.Dim("ar", min=1, max=ar)
    past, dims = [], []
    for kind in t.layer_types:
        if kind == "conv":
            past, dims = past + [torch.zeros(t.conv_kernel - 1, t.hidden)], dims + [None]
        else:  # two tensors: the exporter folds one tensor passed twice into one input
            past, dims = past + [torch.zeros(max_context, t.kv_dim), torch.zeros(max_context, t.kv_dim)], dims + [{0: ctx}] * 2
    args = (torch.zeros(ar, t.hidden), torch.arange(ar), torch.zeros(ar, max_context + ar), *past, torch.arange(ar))
    dynamic = (({0: n}, {0: n}, {0: n, 1: torch.export.Dim.AUTO}, *dims, {0: torch.export.Dim("rows", min=1, max=ar)}),)
    path = tmp_path / "decoder.onnx"
    export_graph(CastIO(dec, torch.float32, torch.float32), args,
                 ["inputs_embeds", "position_ids", "attention_mask", *ins, "logit_rows"], ["logits", *outs], path, dynamic)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(*a):
        return sess.run(None, dict(zip(names, a)))

    im = tiles_of((150, 220))
    ids, want = hf_generate(first.model, first.proc, [im], PROMPT, 24)
    e = first.embeds(ids, [im])
    for block in (1, ar):
        assert greedy(run, first.state(), first.embed, e, 24, block=block, logit_rows=True) == want, block
