"""What the shared family runner (test_family_conformance.py) and the family test files use to hold a bundle
against transformers: transformers' answers memoized per checkpoint and request, `vlmrt run --json` in process,
transformers' greedy ids for given prompt ids, and the path tests' three images of different sizes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
from PIL import Image

import oracle
from vlmrt import cli

_HF_RUNS: dict[tuple, tuple] = {}


def hf_run(ex, image_path, prompt: str, n: int, ignore_eos: bool = True):
    """transformers' (prompt ids, pixels, greedy ids) for an exported case (conftest.Exported), computed once per
    checkpoint and request (the kv and hybrid modes compare with the same reference); n=0: the processor alone.
    pixels as the family's processor gives them ([1, tiles, ...] where ex.family.pixel_batch_dim)."""
    key = (str(ex.ckpt), Path(image_path).name if image_path else None, prompt, n, ignore_eos)
    if key not in _HF_RUNS:
        model, proc = ex.hf()
        im = Image.open(image_path) if image_path else None
        if im is not None and ex.family.rgb:  # transformers' own conversion (transparency onto white)
            from transformers.image_transforms import convert_to_rgb

            im = Image.fromarray(convert_to_rgb(im, return_numpy=True))
        _HF_RUNS[key] = oracle.generate(ex.family, ex.ckpt, im, prompt, n, ignore_eos=ignore_eos, model=model,
                                        processor=proc)
    return _HF_RUNS[key]


def cli_json(capsys, *args) -> dict:
    """`vlmrt run ARGS --json` in process: its exit status must be 0; returns the JSON result line."""
    capsys.readouterr()
    assert cli.main(["run", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def hf_greedy_from_ids(model, ids, pixels, n):
    """transformers generate on given prompt ids + pixel values (EOS ignored)."""
    import torch

    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None
    kw = {"pixel_values": torch.from_numpy(pixels)} if pixels is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=n, generation_config=cfg, **kw)
    return out[0, len(ids):].tolist()


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed + w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


def three_images(ex) -> list[str]:
    """Paths of three random images in ex's folder: 250×160 (Qwen-VL: resized down to the processor's max_pixels;
    LFM2-VL: a 3×2 grid + thumbnail at the fixture's 64² tiles), 300×90 (wide), 40×40 (small: Qwen-VL scales it up to
    min_pixels, LFM2-VL gives it one tile)."""
    out = []
    for k, (w, h) in enumerate([(250, 160), (300, 90), (40, 40)]):
        p = ex.tmp / f"p{k}.png"
        picture(w, h).save(p)
        out.append(str(p))
    return out
