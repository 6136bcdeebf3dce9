"""Qwen2.5-VL / Qwen3-VL decoding in torch against transformers on tiny random checkpoints: the host's M-RoPE
positions (runtime/prompt/mrope.py) equal `get_rope_index`; our vision tower + M-RoPE decoder with DeepStack
(families/qwen_vl/language.py), prompt processed whole then decoded token by token over its own K/V rows (positions
continuing at the prompt's largest + 1), give transformers' logits and 24 greedy ids equal to `generate`, with two
images of different grids; DeepStack left out is caught."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from fixtures_qwen import EOS_ID, IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, loaded, make_model  # noqa: E402
from test_qwen_vision import MASK, ops, params, patches_of  # noqa: E402
from vlmrt.families.qwen_vl import vision  # noqa: E402
from vlmrt.runtime.prompt import mrope  # noqa: E402
from vlmrt.runtime.media import vision_inputs as vi  # noqa: E402

KINDS = ("qwen2_5_vl", "qwen3_vl")


def prompt_ids(token_counts: list[int], seed: int = 0) -> list[int]:
    """Text, then per image <|vision_start|> image tokens <|vision_end|> text (random text ids below 1000)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 1000, 5).tolist()
    for n in token_counts:
        ids += [VISION_START_ID] + [IMAGE_TOKEN_ID] * n + [VISION_END_ID] + rng.integers(4, 1000, 4).tolist()
    return ids


def rope_index(model, ids, grids):
    ids_t = torch.tensor([ids])
    types = (ids_t == IMAGE_TOKEN_ID).int()
    pos, delta = model.model.get_rope_index(ids_t, types, image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0].numpy(), int(delta)


@pytest.mark.parametrize("kind", KINDS)
def test_positions_equal_get_rope_index(kind):
    model = make_model(kind)
    cases = [[(1, 8, 12)], [(1, 12, 8), (1, 4, 4)], [(1, 2, 2), (1, 6, 10), (1, 14, 4)]]
    for grids in cases:
        ids = prompt_ids([h * w // 4 for _, h, w in grids])
        want, delta = rope_index(model, ids, grids)
        got = mrope.mrope_positions(ids, grids, IMAGE_TOKEN_ID, 2)
        np.testing.assert_array_equal(got, want)
        assert mrope.next_position(got) == len(ids) + delta  # the decode position: transformers' rope delta
        for cut in (3, 7, len(ids) - 2):  # a later part of the prompt (a prefix reused) from its start position
            tail_grids = [g for g, (a, _) in zip(grids, mrope.image_runs(np.array(ids), IMAGE_TOKEN_ID)) if a >= cut]
            if any(a < cut < b for a, b in mrope.image_runs(np.array(ids), IMAGE_TOKEN_ID)):
                continue  # a cut inside an image is not a prompt part
            start = int(want[:, :cut].max()) + 1 if cut else 0
            np.testing.assert_array_equal(mrope.mrope_positions(ids[cut:], tail_grids, IMAGE_TOKEN_ID, 2, start),
                                          want[:, cut:])
    text = prompt_ids([])
    np.testing.assert_array_equal(mrope.mrope_positions(text, [], IMAGE_TOKEN_ID, 2), np.tile(np.arange(len(text)), (3, 1)))
    with pytest.raises(ValueError, match="has 5 image tokens"):
        mrope.mrope_positions(prompt_ids([5]), [(1, 4, 4)], IMAGE_TOKEN_ID, 2)
    with pytest.raises(ValueError, match="2 runs of image tokens for 1 images"):
        mrope.mrope_positions(prompt_ids([4, 4]), [(1, 4, 4)], IMAGE_TOKEN_ID, 2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (config, transformers' model, our vision tower, our decoder, embedding table)."""
    return {kind: loaded(kind, tmp_path_factory)[:5] for kind in KINDS}


def encode(cfg, tower, p):
    """(image tokens [n, hidden], DeepStack features [n, levels*hidden] or None) through our tower."""
    f = vi.build_feeds(p.patches, p.grid, ops(cfg), params(cfg), len(p.patches), MASK)
    names = vision.input_names(cfg.vision)
    with torch.no_grad():
        outs = tower(*[torch.from_numpy(f.feeds[n]) for n in names])
    outs = [f.restore(o.numpy()) for o in (outs if isinstance(outs, tuple) else (outs,))]
    return outs[0], (np.concatenate(outs[1:], axis=1) if len(outs) > 1 else None)


def ours_generate(cfg, tower, dec, embed, ids, images, steps: int, deepstack: bool = True):
    """Prompt whole (one step, empty cache), then one token per step over the K/V rows: (first logits, ids)."""
    grids = [p.grid for p in images]
    x = embed[torch.tensor(ids)].clone()
    levels = len(cfg.vision.deepstack_layers)
    ds = torch.zeros(len(ids), levels * cfg.text.hidden)
    image_rows = np.flatnonzero(np.array(ids) == IMAGE_TOKEN_ID)
    enc = [encode(cfg, tower, p) for p in images]
    x[image_rows] = torch.from_numpy(np.concatenate([e[0] for e in enc]))
    if levels and deepstack:
        ds[image_rows] = torch.from_numpy(np.concatenate([e[1] for e in enc]))
    pos = mrope.mrope_positions(ids, grids, IMAGE_TOKEN_ID, cfg.vision.merge)
    kv = cfg.text.kv_dim
    past = [torch.zeros(0, kv) for _ in range(2 * cfg.text.layers)]
    n = len(ids)
    mask = torch.triu(torch.full((n, n), MASK), 1)
    extra = (ds,) if levels else ()
    out = []
    with torch.no_grad():
        logits, *new = dec(x, torch.from_numpy(pos), *extra, mask, *past)
        first = logits.numpy()
        past = new
        at = mrope.next_position(pos)
        for _ in range(steps):
            tok = greedy(logits[-1].numpy())
            out.append(tok)
            step_pos = torch.full((3, 1), at, dtype=torch.int64)
            at += 1
            ctx = past[0].shape[0]
            extra = (torch.zeros(1, levels * cfg.text.hidden),) if levels else ()
            logits, *new = dec(embed[torch.tensor([tok])], step_pos, *extra, torch.zeros(1, ctx + 1), *past)
            past = [torch.cat([p_, r]) for p_, r in zip(past, new)]
    return first, out


def greedy(logits: np.ndarray) -> int:
    """The greedy choice with EOS ruled out, as generate(min_new_tokens = all of them) rules it out: the answers
    compared are always the full length."""
    logits = logits.copy()
    logits[EOS_ID] = -np.inf
    return int(logits.argmax())


def reference(model, ids, images, steps: int):
    pixels = torch.from_numpy(np.concatenate([p.patches for p in images]))
    grid = torch.tensor([p.grid for p in images])
    ids_t = torch.tensor([ids])
    kw = dict(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), pixel_values=pixels, image_grid_thw=grid,
              mm_token_type_ids=(ids_t == IMAGE_TOKEN_ID).int())
    with torch.no_grad():
        logits = model(**kw).logits[0].numpy()
        gen = model.generate(**kw, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return logits, gen[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_ids_equal_generate(kind, models):
    """Two images of different grids (one with ragged windows), 24 greedy ids."""
    cfg, model, tower, dec, embed = models[kind]
    images = [patches_of(kind, (140, 154), seed=4), patches_of(kind, (84, 196), seed=5)]
    ids = prompt_ids([p.tokens for p in images], seed=1)
    want_logits, want_ids = reference(model, ids, images, 24)
    logits, got = ours_generate(cfg, tower, dec, embed, ids, images, 24)
    # measured: max |Δ| 1.2e-5 (Qwen2.5-VL), 5.8e-6 (Qwen3-VL) of logits up to 4.5, fp32 both sides
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=5e-5)
    assert got == want_ids


def test_deepstack_left_out_is_caught(models):
    """Qwen3-VL without DeepStack runs and answers, wrongly: logits far outside the tolerance above (measured: 3.5
    apart)."""
    cfg, model, tower, dec, embed = models["qwen3_vl"]
    images = [patches_of("qwen3_vl", (140, 154), seed=4)]
    ids = prompt_ids([p.tokens for p in images], seed=1)
    want_logits, _ = reference(model, ids, images, 1)
    logits, _ = ours_generate(cfg, tower, dec, embed, ids, images, 0, deepstack=False)
    assert np.abs(logits - want_logits).max() > 100 * 5e-5


def test_config_refusals_name_the_feature(tmp_path):
    """A checkpoint with a feature vlmrt does not export is refused in one line that names it."""
    from fixtures_qwen import make_model
    from vlmrt.families.decoder import UnsupportedCheckpoint
    from vlmrt.families.qwen_vl.config import QwenVLConfig

    base = make_model("qwen3_vl").config.to_dict()
    QwenVLConfig.from_hf(base)  # the tiny one is fine

    def refused(change, match):
        cfg = json.loads(json.dumps(base))
        change(cfg)
        with pytest.raises(UnsupportedCheckpoint, match=match) as e:
            QwenVLConfig.from_hf(cfg)
        assert "\n" not in str(e.value)

    refused(lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn", factor=2.0), "text rope type 'yarn'")
    refused(lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 3]), r"mrope_section \[2, 3\]")
    refused(lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 4, 4]), "does not cover head_dim 16")
    refused(lambda c: c["vision_config"].update(rope_parameters={"rope_type": "linear"}), "vision rotary type 'linear'")
    refused(lambda c: c["vision_config"].update(num_position_embeddings=40), "num_position_embeddings 40")
    refused(lambda c: c.update(model_type="qwen2_vl"), "model type 'qwen2_vl'")
