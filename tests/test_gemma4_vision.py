"""Gemma 4's vision tower + embedder (families/gemma4/vision.py) as one static graph over a patch budget, against
transformers' Gemma4Model.get_image_features on a tiny random Gemma4ForConditionalGeneration, fed the patch rows and
positions transformers' own Gemma4ImageProcessor makes: images of different aspect ratios (wide, tall, square; fewer
soft tokens than the budget, so padding rows are present), through the torch module and the exported ONNX graph
(one export, ~5 s). The image-token rows carry the pad token's per-layer rows beside the projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrt.export import graphs
from vlmrt.families.gemma4 import language, vision
from vlmrt.families.gemma4.config import Gemma4TextConfig
from vlmrt.families.weights import Tensors

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size_per_layer_input=300, hidden_size_per_layer_input=8, num_hidden_layers=2,
            sliding_window=5, global_head_dim=16, layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=128, standardize=True)
SOFT = 70  # max_soft_tokens (transformers allows 70, 140, 280, 560, 1120)
BUDGET = SOFT * 9
SIZES = [(37, 90), (120, 41), (50, 50)]  # (height, width)


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor

    cfg = Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=299,
                       boi_token_id=297, eoi_token_id=298)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # spread what a random init leaves at 1 / 0 / small
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "position_embedding" in n:
                p.normal_()
            elif p.dim() == 2:
                p.mul_(5)
        model.model.vision_tower.std_bias.normal_()
        model.model.vision_tower.std_scale.uniform_(0.5, 2)
    sd = model.state_dict()
    text = Gemma4TextConfig.from_hf(cfg.text_config.to_dict())
    _, table = language.load(text, Tensors(sd), "model.language_model.")
    table = torch.from_numpy(table.rows(0, 1))
    module = vision.load(cfg.vision_config.to_dict(), sd.__getitem__, "model.", text.hidden, table[0, text.hidden:],
                         BUDGET)
    path = tmp_path_factory.mktemp("gemma4-vision") / "vision.onnx"
    graphs.export_vision(module, module.example_inputs(BUDGET, 48), ["image_embeds"], "fp32", "fp32", path)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    proc = Gemma4ImageProcessor(patch_size=4, max_soft_tokens=SOFT, pooling_kernel_size=3)
    return model, module, session, proc, table[0, text.hidden:]


@pytest.mark.parametrize("size", SIZES)
def test_tower_equals_transformers_at_each_aspect_ratio(tower, size):
    model, module, session, proc, pad_rows = tower
    rgb = (np.random.default_rng(sum(size)).random((*size, 3)) * 255).astype(np.uint8)
    f = proc(images=[Image.fromarray(rgb)], return_tensors="pt")
    patches, positions = f["pixel_values"][0], f["image_position_ids"][0]
    n = int(f["num_soft_tokens_per_image"][0])
    assert n < SOFT and (positions == -1).all(-1).any()  # padding rows present
    with torch.no_grad():
        want = model.model.get_image_features(f["pixel_values"], f["image_position_ids"], return_dict=True).pooler_output
        want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
        got = module(patches, positions)
    assert want.shape == (n, TEXT["hidden_size"])
    assert torch.allclose(got[:n, : TEXT["hidden_size"]], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:n, TEXT["hidden_size"]:], pad_rows.expand(n, -1))
    (ort_out,) = session.run(None, {"pixel_patches": patches.numpy(), "positions": positions.numpy()})
    assert np.allclose(ort_out[:n, : TEXT["hidden_size"]], want.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("size", SIZES + [(8, 200)])
def test_host_patches_equal_the_processor_and_feed_the_tower(tower, size):
    """The runtime's pooled_aspect tiling and pooled_positions inputs (runtime/media/image_pooled.py): patch rows and
    positions bit-equal to transformers' Gemma4ImageProcessorPil (a thin 8×200 image: one kernel high), the token
    count its num_soft_tokens_per_image, and the graph fed them gives transformers' image features."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from vlmrt.format.manifest import ImageSpec
    from vlmrt.runtime.media import image_pooled
    from vlmrt.runtime.media.image import TILING

    model, _, session, _, _ = tower
    spec = ImageSpec(tiling="pooled_aspect", tile_size=12, patch_size=4, resample="bicubic", rescale_factor=1 / 255,
                     mean=[0.0] * 3, std=[1.0] * 3, params={"max_soft_tokens": SOFT, "pooling_kernel": 3})
    im = Image.fromarray((np.random.default_rng(sum(size)).random((*size, 3)) * 255).astype(np.uint8))
    tiles = TILING["pooled_aspect"](im, spec)
    pil = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=SOFT, pooling_kernel_size=3)
    f = pil(images=[im], return_tensors="np")
    positions = image_pooled.positions(tiles.patch_grids[0], BUDGET)
    assert np.array_equal(tiles.pixels[0], f["pixel_values"][0])
    assert np.array_equal(positions, f["image_position_ids"][0])
    n = image_pooled.tokens(tiles.patch_grids[0], 3)
    assert n == int(f["num_soft_tokens_per_image"][0]) == tiles.rows * tiles.cols
    with torch.no_grad():
        want = model.model.get_image_features(torch.from_numpy(f["pixel_values"]),
                                              torch.from_numpy(f["image_position_ids"]), return_dict=True).pooler_output
        want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
    (got,) = session.run(None, {"pixel_patches": tiles.pixels[0], "positions": positions})
    assert np.allclose(got[:n, : TEXT["hidden_size"]], want.numpy(), atol=1e-4, rtol=1e-4)


def test_fp16_graph_loads_and_follows_the_float_one(tower, tmp_path):
    """`vlmrt export --dtype fp16`'s vision graph: the pooling runs in float32 and the projection back in fp16 (before,
    ONNX Runtime refused the graph: a Gemm bound to float and float16), its rows within fp16 rounding of fp32's."""
    import onnxruntime as ort

    _, module, session, proc, _ = tower
    path = tmp_path / "vision16.onnx"
    graphs.export_vision(module, module.example_inputs(BUDGET, 48), ["image_embeds"], "fp16", "fp16", path)
    half = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rgb = (np.random.default_rng(3).random((37, 90, 3)) * 255).astype(np.uint8)
    f = proc(images=[Image.fromarray(rgb)], return_tensors="np")
    n = int(f["num_soft_tokens_per_image"][0])
    (want,) = session.run(None, {"pixel_patches": f["pixel_values"][0], "positions": f["image_position_ids"][0]})
    (got,) = half.run(None, {"pixel_patches": f["pixel_values"][0].astype(np.float16),
                             "positions": f["image_position_ids"][0]})
    assert got.dtype == np.float16
    scale = np.abs(want[:n]).max()
    assert np.abs(got[:n].astype(np.float32) - want[:n]).max() < 2e-2 * scale
