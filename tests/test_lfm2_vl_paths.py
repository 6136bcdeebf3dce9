"""What users have, on an LFM2-VL bundle (family_cases.LFM2_CASES[0]: conv layers beside GroupQueryAttention, the
CPU default kind), beyond the commands every family's paths case runs (test_family_paths.py: chat, eval, bench,
batch, serve, the weight-only precisions): `vlmrt run` with several images of different sizes, `--max-tiles`
(LFM2-VL's processor setting of that name) against transformers' processor at that setting, `--lookahead`. Each
answer equals transformers' or plain decoding's."""

from __future__ import annotations

import pytest
from PIL import Image

from family_cases import LFM2_CASES, lfm2_exported
from family_runner import cli_json, three_images

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

PROMPT = "What is in the image? Describe the colours."


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    return lfm2_exported(LFM2_CASES[0], tmp_path_factory)


@pytest.fixture(scope="module")
def images(ex):
    return three_images(ex)


def test_max_tiles_equals_the_processor_at_that_setting(ex, images, capsys):
    """--max-tiles 3 tiles as Lfm2VlImageProcessor(max_tiles=3): prompt ids and 24 greedy ids of transformers."""
    from fixtures_lfm2_vl import hf_generate, hf_processor

    model, _ = ex.hf()
    proc = hf_processor(ex.ckpt)
    proc.image_processor.max_tiles = 3
    ims = [Image.open(images[0])]
    ids, want = hf_generate(model, proc, ims, PROMPT, 24)
    full = cli_json(capsys, ex.bundle, "--image", images[0], "--prompt", PROMPT, "--max-new-tokens", 4)
    got = cli_json(capsys, ex.bundle, "--image", images[0], "--prompt", PROMPT, "--max-tiles", 3, "--max-new-tokens", 24,
                   "--ignore-eos")
    assert got["prompt_tokens"] == len(ids) < full["prompt_tokens"] and got["token_ids"] == want
    assert got["stats"]["image_tiles"] < full["stats"]["image_tiles"]


def test_lookahead_run_equals_plain(ex, images, capsys):
    args = [ex.bundle, "--image", images[1], "--image", images[2], "--prompt", "red blue red blue red blue",
            "--max-new-tokens", 24, "--ignore-eos"]
    assert cli_json(capsys, *args, "--lookahead", 3)["token_ids"] == cli_json(capsys, *args)["token_ids"]
