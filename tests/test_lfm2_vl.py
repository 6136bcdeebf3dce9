"""LFM2-VL against transformers on tiny random checkpoints (tests/fixtures_lfm2_vl.py): the vision graph (SigLIP2
NaFlex + projector, host-made position weights and key mask: runtime/naflex.py) per tile of many sizes."""

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
