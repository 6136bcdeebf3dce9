"""Qwen2.5-VL / Qwen3-VL bundles through the real runtime against transformers (what the shared conformance runner
does not cover): two images of different grids in one prompt, one resized down by the processor's max_pixels and one
up by its min_pixels, an image straddling a prefill block, in kv and hybrid modes; a follow-up turn through
vlm.chat reusing the first turn's KV rows and image; the run-time patch budget (--max-patches). The same prompt with
DeepStack's rows zeroed, the window order not undone or M-RoPE's positions replaced by slots answers otherwise
(each planted here, so the equality tests can fail)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from family_cases import QWEN_CASES, qwen_exported
from fixtures_qwen import MAX_BLOCKS, MIN_BLOCKS, factor
from family_runner import cli_json

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import oracle  # noqa: E402
from conftest import image_file  # noqa: E402
from vlmrt.runtime.prompt import positions as pos_ops  # noqa: E402
from vlmrt.runtime.media import vision_inputs  # noqa: E402
from vlmrt.runtime.prompt.chunks import Prompt  # noqa: E402
from vlmrt.runtime.vlm import VLM  # noqa: E402

PROMPT = "Compare the two images. What differs?"
STEPS = 24
_HF: dict = {}


@pytest.fixture(params=QWEN_CASES, ids=[c.name for c in QWEN_CASES])
def ex(request, tmp_path_factory):
    return qwen_exported(request.param, tmp_path_factory)


def small_image(tmp_path):
    """An image below min_pixels (the processor scales it up)."""
    p = tmp_path / "small.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(p)
    return p


def hf(ex, turns: list, images: list, n: int = STEPS):
    """transformers' (prompt ids, image_grid_thw, n greedy ids) for a conversation of HF-style turns."""
    key = (ex.case.name, repr(turns), tuple(str(i) for i in images), n)
    if key not in _HF:
        model, proc = ex.hf()
        text = proc.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        inputs = proc(text=[text], images=[Image.open(i).convert("RGB") for i in images] or None, return_tensors="pt")
        _HF[key] = (inputs["input_ids"][0].tolist(), inputs["image_grid_thw"].tolist(),
                    oracle.greedy_new_ids(model, inputs, n, ignore_eos=True))
    return _HF[key]


def two_images(tmp_path):
    return [image_file("chelsea.png", None), small_image(tmp_path)]


def user(images, text):
    return {"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_two_images_at_max_and_min_pixels_equal_transformers(ex, mode, tmp_path):
    images = two_images(tmp_path)
    ids, grids, want = hf(ex, [user(images, PROMPT)], images)
    vlm = VLM.load(ex.bundle)
    p = vlm.prompt(PROMPT, images)
    assert p.ids == ids
    f = factor(ex.case.kind)
    big, small = [c for _, c in p.images()]
    # the photo is resized down to the processor's max_pixels, the small one up to its min_pixels, as transformers does
    assert [[1, 2 * c.grid[0], 2 * c.grid[1]] for c in (big, small)] == grids
    assert 451 * 300 > MAX_BLOCKS * f * f >= big.grid[0] * big.grid[1] * f * f > 0.8 * MAX_BLOCKS * f * f
    assert 20 * 30 < MIN_BLOCKS * f * f <= small.grid[0] * small.grid[1] * f * f
    ar = ex.case.prefill_ar
    assert any(o // ar != (o + c.n_tokens - 1) // ar for o, c in p.images())  # an image straddles a prefill block
    r = vlm(PROMPT, images=images, mode=mode, max_new_tokens=STEPS, ignore_eos=True)
    assert len(set(want)) > 4 and r.token_ids == want
    assert r.stats.images_resized == 0  # the processor's own max_pixels decided, not the vision graph's budget


def test_follow_up_turn_reuses_the_cache_and_equals_transformers(ex, tmp_path):
    images = [image_file("chelsea.png", None)]
    vlm = VLM.load(ex.bundle)
    url = {"type": "image_url", "image_url": {"url": str(images[0])}}
    messages = [{"role": "user", "content": [url, {"type": "text", "text": "What is in the image?"}]}]
    first = "".join(vlm.chat(messages, max_new_tokens=12, ignore_eos=True))
    assert vlm.result.token_ids == hf(ex, [user(images, "What is in the image?")], images, 12)[2]
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And the colours?"}]
    turns = [user(images, "What is in the image?"), {"role": "assistant", "content": first},
             {"role": "user", "content": "And the colours?"}]
    ids, _, want = hf(ex, turns, images)
    "".join(vlm.chat(messages, max_new_tokens=STEPS, ignore_eos=True))
    s = vlm.result.stats
    assert vlm.result.prompt_ids == ids and vlm.result.token_ids == want
    assert s.reused_prompt_tokens >= ex.case.prefill_ar and s.images_cached == 1 and s.vision_skipped


def test_max_patches_at_run_time(ex, tmp_path, capsys):
    """--max-patches: the image resized as the processor resizes it under max_pixels = patches × patch²."""
    images = [image_file("chelsea.png", None)]
    f = factor(ex.case.kind)
    got = cli_json(capsys, ex.bundle, "--image", images[0], "--prompt", "Describe it.", "--max-patches", 64,
                   "--max-new-tokens", 8, "--ignore-eos")
    model, proc = ex.hf()
    proc.image_processor.max_pixels = proc.image_processor.size["longest_edge"] = 64 * (f // 2) ** 2
    text = proc.apply_chat_template([user(images, "Describe it.")], add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[Image.open(images[0]).convert("RGB")], return_tensors="pt")
    want = oracle.greedy_new_ids(model, inputs, 8, ignore_eos=True)
    ex._hf = None  # (the processor changed: reload it for the other tests)
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1] < 64 + 40 and got["token_ids"] == want
    assert got["stats"]["images_resized"] == 1  # smaller than the bundle's processor makes it: said, not refused


_WINDOW_ORDER = vision_inputs.window_order


def raster_windows(*args):
    order, windows = _WINDOW_ORDER(*args)
    return np.arange(len(order)), windows


PLANTS = {
    "deepstack zeroed": ("qwen3_vl", lambda mp: mp.setattr(Prompt, "row_input", lambda self, h, w, dt, start=0:
                                                            np.zeros((self.n_tokens - start, w), dt))),
    # (the merge blocks in raster order under the window masks; the tokens left in window order instead changes no
    # greedy id of these tiny models: test_qwen_vision holds the tower's outputs, put back, to 4.9e-6)
    "window order left out": ("qwen2_5_vl", lambda mp: mp.setattr(vision_inputs, "window_order", raster_windows)),
    "positions as slots": (None, lambda mp: mp.setitem(pos_ops.POSITION_OPS, "mrope", lambda spec, p, start, first:
                                                      pos_ops.slots(spec, p, start, start))),
}


PLANTED = [(c, plant) for c in QWEN_CASES[:2] for plant, (kind, _) in PLANTS.items() if kind in (None, c.kind)]


@pytest.mark.parametrize("case,plant", PLANTED, ids=[f"{c.name}-{plant}" for c, plant in PLANTED])
def test_planted_faults_change_the_answer(case, plant, tmp_path, tmp_path_factory, monkeypatch):
    ex = qwen_exported(case, tmp_path_factory)
    do = PLANTS[plant][1]
    images = two_images(tmp_path)
    _, _, want = hf(ex, [user(images, PROMPT)], images)
    do(monkeypatch)
    vlm = VLM.load(ex.bundle)
    assert vlm(PROMPT, images=images, mode="hybrid", max_new_tokens=STEPS, ignore_eos=True).token_ids != want


def test_export_patch_budget_option(tmp_path, capsys):
    """`vlmrt export --max-patches 64`: the vision graph's rows, the manifest's budget and tokens per tile, said by
    the export's first line; a budget that is no whole merge block, or --max-patches for a family without one, is
    one line and no bundle; a run-time --max-patches above the graph's is refused the same way."""
    from fixtures_qwen import make_full_checkpoint
    from vlmrt import cli
    from vlmrt.format import manifest as mf

    ckpt = make_full_checkpoint("qwen2_5_vl", tmp_path / "ckpt", seed=11)
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), str(tmp_path / "b64"), "--max-patches", "64", "--prefill-ar", "8"]) == 0
    err = capsys.readouterr().err
    assert "patch budget 64 patches (from --max-patches)" in err
    m = mf.load(tmp_path / "b64")
    assert m.image.params["max_patches"] == 64 and m.prompt.tokens_per_tile == 16
    assert m.graphs["vision"].input("pixel_patches").shape == [64, 3 * 2 * 14 * 14]
    assert cli.main(["export", str(ckpt), str(tmp_path / "bad"), "--max-patches", "66"]) != 0
    err = capsys.readouterr().err
    assert "not a multiple of 4" in err and "Traceback" not in err and not (tmp_path / "bad").exists()
    image = image_file("chelsea.png", None)
    assert cli.main(["run", str(tmp_path / "b64"), "--image", str(image), "--prompt", "Hi", "--max-patches", "128"]) != 0
    err = capsys.readouterr().err
    assert "--max-patches must be between 4 and this bundle's vision graph budget, 64" in err and "Traceback" not in err


def test_max_patches_refused_for_a_family_without_a_budget(default_bundle, tmp_path, capsys):
    from vlmrt import cli

    capsys.readouterr()
    assert cli.main(["export", str(default_bundle.ckpt), str(tmp_path / "b"), "--max-patches", "64"]) != 0
    err = capsys.readouterr().err
    assert "--max-patches is the patch budget of a native-resolution image op" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
