"""What users have, on a Qwen3-VL bundle (family_cases.QWEN_CASES[1]: M-RoPE positions, DeepStack's row input, the
gqa_in_place CPU kind), beyond the commands every family's paths case runs (test_family_paths.py: chat, eval, bench,
batch, serve, the GPTQ precisions): `vlmrt run` with several images of different grids and `--lookahead`, equal to
transformers."""

from __future__ import annotations

import pytest
from PIL import Image

from family_cases import QWEN_CASES, qwen_exported
from family_runner import cli_json, three_images

pytest.importorskip("transformers")

PROMPT = "What is in the image? Describe the colours."


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    return qwen_exported(QWEN_CASES[1], tmp_path_factory)


@pytest.fixture(scope="module")
def images(ex):
    return three_images(ex)


def test_several_images_and_lookahead_equal_transformers(ex, images, capsys):
    """Three images of different grids in one `vlmrt run`: 24 greedy ids = transformers'; --lookahead 3 the same."""
    import oracle

    model, proc = ex.hf()
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": PROMPT}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[Image.open(p).convert("RGB") for p in images], return_tensors="pt")
    want = oracle.greedy_new_ids(model, inputs, 24, ignore_eos=True)
    args = [ex.bundle, *[x for p in images for x in ("--image", p)], "--prompt", PROMPT, "--max-new-tokens", 24,
            "--ignore-eos"]
    got = cli_json(capsys, *args)
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1] and got["token_ids"] == want
    la = cli_json(capsys, *args, "--lookahead", 3)
    assert la["token_ids"] == want and la["stats"]["drafted_tokens"] > 0  # (drafts verified, with zero row input)
