"""The Qwen2.5-VL / Qwen3-VL vision towers: the host-computed grid inputs (runtime/media/vision_inputs.py) equal
transformers' vision_utils; our static tower (families/qwen_vl/vision.py) fed with them, in torch and exported as
one ONNX graph padded to a patch budget, equals transformers' vision tower on tiny random checkpoints; a window order
left out is caught."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from fixtures_qwen import VISION_PATHS, loaded, vision_graph  # noqa: E402
from vlmrt.families.qwen_vl import vision  # noqa: E402
from test_image_native import spec  # noqa: E402
from vlmrt.runtime.media import image_native as native  # noqa: E402
from vlmrt.runtime.media import vision_inputs as vi  # noqa: E402

KINDS = ("qwen2_5_vl", "qwen3_vl")
MASK = float(np.finfo(np.float32).min)
BUDGET = 160  # the exported graph's patch rows
# (height, width) in pixels; Qwen2.5-VL (14 px patches, windows of 2x2 merge blocks) and Qwen3-VL (16 px) grids:
# square, wide, tall, ragged windows (odd block counts), a single merge block
SIZES = [(112, 112), (84, 196), (196, 84), (140, 154), (28, 28), (150, 230)]


def noise(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """kind -> (config, transformers' vision tower, ours loaded from the saved checkpoint)."""
    out = {}
    for kind in KINDS:
        cfg, model, tower, *_ = loaded(kind, tmp_path_factory)
        out[kind] = (cfg, model.model.visual, tower)
    return out


def patches_of(kind, size, budget=10**6, seed=0):
    v = 14 if kind == "qwen2_5_vl" else 16
    s = spec(kind, 4 * (2 * v) ** 2, 64 * (2 * v) ** 2, max_patches=budget)
    return native.smart_resize_patches(noise(*size, seed=seed), s)


def params(cfg):
    return vision.host_inputs(cfg.vision)[1]


def ops(cfg):
    return vision.host_inputs(cfg.vision)[0]


def reference(visual, p: native.NativePatches):
    """transformers' tower on the processor's patches: (tokens [n, out], [DeepStack features])."""
    with torch.no_grad():
        out = visual(torch.from_numpy(p.patches), grid_thw=torch.tensor([p.grid]))
    return out.pooler_output.numpy(), [f.numpy() for f in (getattr(out, "deepstack_features", None) or [])]


def run_ours(cfg, tower, p: native.NativePatches, rows: int, order_ops=None):
    f = vi.build_feeds(p.patches, p.grid, order_ops or ops(cfg), params(cfg), rows, MASK)
    names = vision.input_names(cfg.vision)
    with torch.no_grad():
        outs = tower(*[torch.from_numpy(f.feeds[n]) for n in names])
    outs = outs if isinstance(outs, tuple) else (outs,)
    return [f.restore(o.numpy()) for o in outs], f, names


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_grid_inputs_equal_transformers(kind, size, towers):
    from transformers.vision_utils import (get_vision_interpolation_indices_and_weights, get_vision_position_ids,
                                           get_vision_window_index)

    cfg, visual, _ = towers[kind]
    v = cfg.vision
    p = patches_of(kind, size)
    _, gh, gw = p.grid
    grid = torch.tensor([p.grid])
    pos = get_vision_position_ids(grid, v.merge)
    with torch.no_grad():
        cos, sin = visual.rotary_pos_emb(torch.zeros(1), pos)
    ours_cos, ours_sin = vi.rotary_2d(gh, gw, v.merge, v.head_dim, v.theta)
    # measured: max |Δ| 6e-8, 1 ulp (float64 cos / sin rounded to float32 vs torch's float32 kernels)
    np.testing.assert_allclose(ours_cos, cos.numpy(), rtol=0, atol=2e-7)
    np.testing.assert_allclose(ours_sin, sin.numpy(), rtol=0, atol=2e-7)
    if kind == "qwen2_5_vl":
        want_order, cu = get_vision_window_index(grid, v.merge, v.window, v.patch)
        order, wins = vi.window_order(gh, gw, v.merge, v.window, v.patch)
        np.testing.assert_array_equal(order, want_order.numpy())
        sizes = np.unique(wins, return_counts=True)[1] * v.merge_unit  # patches per window, in order
        np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(sizes)]), cu.numpy())
    else:
        want_i, want_w = get_vision_interpolation_indices_and_weights(grid, v.position_side, "bilinear", True, v.merge)
        idx, w = vi.interpolated_positions(gh, gw, v.merge, v.position_side)
        np.testing.assert_array_equal(idx, want_i.numpy())
        np.testing.assert_array_equal(w, want_w.numpy())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_torch_tower_equals_transformers(kind, size, towers):
    """Unpadded and padded to the budget: the same tokens (and DeepStack features) as transformers."""
    cfg, visual, ours = towers[kind]
    p = patches_of(kind, size, budget=BUDGET)
    want, deep = reference(visual, p)
    for rows in (len(p.patches), BUDGET):
        got, _, _ = run_ours(cfg, ours, p, rows)
        assert len(got) == 1 + len(deep) == 1 + len(cfg.vision.deepstack_layers)
        for g, w in zip(got, [want, *deep]):
            assert g.shape == w.shape
            # measured: max |Δ| 4.2e-6 (values up to 3.1), padded or not: the padding changes nothing real rows see
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """kind -> the tower exported as one static ONNX graph of BUDGET rows, as an ORT session (shared)."""
    out = {}
    for kind in KINDS:
        cfg = loaded(kind, tmp_path_factory)[0]
        out[kind] = (vision_graph(kind, tmp_path_factory, BUDGET), vision.input_names(cfg.vision),
                     vision.output_names(cfg.vision))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_graph_equals_transformers(kind, towers, graphs):
    """One static graph for every image size: each of SIZES (and one over the budget, resized to fit) padded to
    BUDGET rows gives transformers' tokens and DeepStack features."""
    cfg, visual, _ = towers[kind]
    sess, names, outputs = graphs[kind]
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    assert shapes["patches"] == [BUDGET, cfg.vision.patch_dim]  # static
    for size in [*SIZES, (600, 500)]:
        p = patches_of(kind, size, budget=BUDGET, seed=1)
        assert len(p.patches) <= BUDGET and p.budget_limited == (size == (600, 500))
        want, deep = reference(visual, p)
        f = vi.build_feeds(p.patches, p.grid, ops(cfg), params(cfg), BUDGET, MASK)
        got = sess.run(outputs, {n: f.feeds[n] for n in names})
        for g, w in zip(got, [want, *deep]):
            # measured: max |Δ| 4.9e-6 over these sizes (ORT's kernels vs torch's eager ones)
            np.testing.assert_allclose(f.restore(g), w, rtol=0, atol=2e-5)


def test_missing_window_order_is_caught(towers):
    """A Qwen2.5-VL tower fed without the window order (patches in raster order, one window per image) answers
    something else: the comparison above would fail (measured: 1.4 apart)."""
    cfg, visual, ours = towers["qwen2_5_vl"]
    p = patches_of("qwen2_5_vl", (140, 154))
    want, _ = reference(visual, p)
    f = vi.build_feeds(p.patches, p.grid, ["rotary_2d"], params(cfg), len(p.patches), MASK)  # no window order
    with torch.no_grad():  # the full mask for window blocks too: what a port without windows computes
        m = torch.from_numpy(f.feeds["attention_mask"])
        got = ours(torch.from_numpy(f.feeds["patches"]), torch.from_numpy(f.feeds["rotary_cos"]),
                   torch.from_numpy(f.feeds["rotary_sin"]), m, m).numpy()
    assert np.abs(got - want).max() > 100 * 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_attention_in_query_blocks_equals_transformers(kind, towers, tmp_path_factory):
    """A budget over vision.QUERY_ROWS: the graph attends in blocks of QUERY_ROWS queries (and a ragged last one),
    each softmax over [heads, <= QUERY_ROWS, budget] (one over [heads, budget, budget] before: 805 MB a tensor at
    the released 4096-patch budget), and still gives transformers' tokens for an image that fills both blocks."""
    import onnx

    rows = vision.QUERY_ROWS + 64
    cfg, visual, _ = towers[kind]
    sess = vision_graph(kind, tmp_path_factory, rows)
    model = onnx.shape_inference.infer_shapes(onnx.load(VISION_PATHS[kind, rows], load_external_data=False))
    shapes = {x.name: [d.dim_value for d in x.type.tensor_type.shape.dim] for x in model.graph.value_info}
    softmax = [shapes[n.input[0]] for n in model.graph.node if n.op_type == "Softmax"]
    assert len(softmax) == 2 * cfg.vision.depth  # two blocks a layer
    assert sorted({s[-2] for s in softmax}) == [64, vision.QUERY_ROWS] and {s[-1] for s in softmax} == {rows}
    v = 14 if kind == "qwen2_5_vl" else 16
    p = native.smart_resize_patches(noise(600, 500, seed=2), spec(kind, 4 * (2 * v) ** 2, 80 * (2 * v) ** 2,
                                                                  max_patches=rows))
    assert vision.QUERY_ROWS < len(p.patches) <= rows
    want, deep = reference(visual, p)
    f = vi.build_feeds(p.patches, p.grid, ops(cfg), params(cfg), rows, MASK)
    got = sess.run(vision.output_names(cfg.vision), {n: f.feeds[n] for n in vision.input_names(cfg.vision)})
    for g, w in zip(got, [want, *deep]):
        np.testing.assert_allclose(f.restore(g), w, rtol=0, atol=2e-5)
