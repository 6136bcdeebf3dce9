"""The tiny random SmolVLM checkpoints of tests/fixtures.py work with transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("num2words")

import torch  # noqa: E402
from fixtures import (  # noqa: E402
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    hf_generate,
    hf_processor,
    image_seq_len_for,
    load_hf_model,
    make_smolvlm_checkpoint,
    make_tokenizer,
)

HERE = Path(__file__).resolve().parent


def _image_path(name: str = "chelsea.png") -> Path:
    for p in (HERE / "assets" / name, HERE.parent.parent / "shared" / "assets" / "images" / name):
        if p.exists():
            return p
    pytest.skip(f"test image {name} not found")


@pytest.fixture(scope="module")
def chelsea():
    from PIL import Image

    with Image.open(_image_path("chelsea.png")) as im:
        return im.convert("RGB")  # 451x300 (w x h)


def test_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert 400 <= len(tok) <= 600
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids[:3] == [0, 1, 2]
    assert ids[3:] == list(range(ids[3], ids[3] + len(SPECIAL_TOKENS) - 3))  # appended in order
    assert tok.eos_token == "<end_of_utterance>" and tok.pad_token == "<|endoftext|>"
    assert tok.image_token == "<image>"
    assert tok.fake_image_token == "<fake_token_around_image>"
    assert tok.global_image_token == "<global-img>"
    assert tok.end_of_utterance_token == "<end_of_utterance>"
    text = "What colour is the cat? There are 3 red circles.\nAnswer: ünïcode ok"
    enc = tok(text).input_ids
    assert tok.decode(enc) == text  # byte-level: lossless, and no BOS/EOS added
    assert len(enc) < len(text.encode()) // 2  # merges were learned
    special = "<|im_start|>User:<fake_token_around_image><row_2_col_3><image><end_of_utterance>"
    c = tok.convert_tokens_to_ids
    expected = [c("<|im_start|>"), *tok("User:").input_ids]
    expected += [c("<fake_token_around_image>"), c("<row_2_col_3>"), c("<image>"), c("<end_of_utterance>")]
    assert tok(special).input_ids == expected


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tied_embeddings(tmp_path, tied):
    ckpt = make_smolvlm_checkpoint(tmp_path / "ckpt", tie_word_embeddings=tied)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "smolvlm"
    assert cfg["architectures"] == ["SmolVLMForConditionalGeneration"]
    assert cfg["tie_word_embeddings"] is tied and cfg["text_config"]["tie_word_embeddings"] is tied
    model = load_hf_model(ckpt)
    emb = model.model.text_model.embed_tokens.weight
    assert model.dtype == torch.float32 and not model.training
    if tied:
        assert model.lm_head.weight.data_ptr() == emb.data_ptr()
    else:
        assert not torch.equal(model.lm_head.weight, emb)
    # weights were re-drawn at unit gain, not left at the 0.02 default init
    assert 0.5 < float(model.lm_head.weight.detach().std()) * 64**0.5 < 2.0


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_generate_with_image(tmp_path, chelsea, tied, split):
    ckpt = make_smolvlm_checkpoint(tmp_path / "ckpt", tie_word_embeddings=tied, do_image_splitting=split)
    model, processor = load_hf_model(ckpt), hf_processor(ckpt)
    prompt_ids, pixel_values, new_ids = hf_generate(
        ckpt, chelsea, "What is in the image?", 24, ignore_eos=True, model=model, processor=processor
    )
    assert len(new_ids) == 24
    assert len(set(new_ids)) > 1, "logits look flat / degenerate"

    seq = image_seq_len_for(64, 8, 2)
    assert seq == 16 == processor.image_seq_len
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert model.config.image_token_id == image_id
    rows, cols = (2, 3) if split else (0, 0)  # 451x300 -> longest edge 192 -> 128x192 -> 2x3 tiles of 64
    n_tiles = rows * cols + 1
    assert prompt_ids.count(image_id) == seq * n_tiles
    assert pixel_values.shape == (1, n_tiles, 3, 64, 64) and pixel_values.dtype == np.float32
    assert -1.0 <= pixel_values.min() < pixel_values.max() <= 1.0
    tok = processor.tokenizer
    for r in range(1, 4):
        for c in range(1, 4):
            expected = 1 if (split and r <= rows and c <= cols) else 0
            assert prompt_ids.count(tok.convert_tokens_to_ids(f"<row_{r}_col_{c}>")) == expected
    assert tok.decode(prompt_ids).startswith("<|im_start|>User:<fake_token_around_image>")
    assert tok.decode(prompt_ids).endswith("What is in the image?<end_of_utterance>\nAssistant:")

    # greedy with KV cache == argmax of one full forward over prompt + generated tokens
    ids = torch.tensor([prompt_ids + new_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=torch.from_numpy(pixel_values)).logits[0]
    assert logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist() == new_ids


def test_generate_text_only(tmp_path):
    ckpt = make_smolvlm_checkpoint(tmp_path / "ckpt")
    prompt_ids, pixel_values, new_ids = hf_generate(ckpt, None, "How many circles are there?", 24, ignore_eos=True)
    tok = hf_processor(ckpt).tokenizer
    assert tok.decode(prompt_ids) == "<|im_start|>User: How many circles are there?<end_of_utterance>\nAssistant:"
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) not in prompt_ids
    assert pixel_values.shape == (1, 0, 3, 64, 64)
    assert len(new_ids) == 24 and len(set(new_ids)) > 1


def test_ignore_eos(tmp_path, chelsea):
    ckpt = make_smolvlm_checkpoint(tmp_path / "ckpt", seed=1)
    _, _, ref = hf_generate(ckpt, chelsea, "Describe the image.", 12, ignore_eos=True)
    # make the 4th generated token the EOS of a copy of the checkpoint
    ckpt2 = tmp_path / "ckpt_eos"
    shutil.copytree(ckpt, ckpt2)
    gc = json.loads((ckpt2 / "generation_config.json").read_text())
    gc["eos_token_id"] = ref[3]
    (ckpt2 / "generation_config.json").write_text(json.dumps(gc))
    first = ref.index(ref[3])
    _, _, stopped = hf_generate(ckpt2, chelsea, "Describe the image.", 12)
    assert stopped == ref[: first + 1]
    _, _, full = hf_generate(ckpt2, chelsea, "Describe the image.", 12, ignore_eos=True)
    assert full == ref


def test_checkpoint_files(tmp_path):
    ckpt = make_smolvlm_checkpoint(
        tmp_path / "ckpt", do_image_splitting=False, tile_size=32, patch_size=4, scale_factor=2, longest_edge_tiles=4
    )
    names = {p.name for p in ckpt.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.json",
        "generation_config.json",
    } <= names
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    assert pre["do_image_splitting"] is False
    assert pre["size"] == {"longest_edge": 128} and pre["max_image_size"] == {"longest_edge": 32}
    assert pre["resample"] == 1 and pre["image_mean"] == [0.5] * 3 and pre["rescale_factor"] == 1 / 255
    assert json.loads((ckpt / "processor_config.json").read_text())["image_seq_len"] == 16
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["vision_config"]["image_size"] == 32 and cfg["vision_config"]["patch_size"] == 4
    gen = json.loads((ckpt / "generation_config.json").read_text())
    tok = hf_processor(ckpt).tokenizer
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<end_of_utterance>")
    assert cfg["text_config"]["vocab_size"] == len(tok)
