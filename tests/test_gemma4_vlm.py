"""Gemma 4 as a registered family (families/gemma4): a tiny random Gemma4ForConditionalGeneration saved by
transformers (tests/fixtures_gemma4.py) through `vlmrt export` (exported once per session, prefill blocks of 16 so
blocks split the images) and `vlmrt run`: the prompt ids and 24 greedy ids equal transformers' Gemma4Processor +
generate with images of two aspect ratios, in kv and hybrid modes; the hub's config form gives the same shapes;
a checkpoint with an audio tower loads its vision and text; bidirectional attention over images is refused at
export in one line (vlmrt's decoder is causal: never a wrong answer)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

PROMPT = "Describe the picture."
SIZES = [(37, 90), (120, 41)]  # (height, width): wide and tall


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from family_cases import GEMMA4_CASES, gemma4_exported

    return gemma4_exported(GEMMA4_CASES[0], tmp_path_factory)  # (the shared runner's export)


def image(size, seed):
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8))


def test_images_of_two_aspect_ratios_equal_generate(bundle, capsys):
    """Two images (wide, tall: 20 and 18 soft tokens, each between <boi> and <eoi>) and text in one turn: the prompt
    ids transformers' processor makes and its 24 greedy ids, in both modes (prefill blocks of 16 split both images)."""
    from family_runner import cli_json
    from fixtures_gemma4 import hf_generate, hf_model, hf_processor

    images = [image(s, k) for k, s in enumerate(SIZES)]
    ids, want = hf_generate(hf_model(bundle.ckpt), hf_processor(bundle.ckpt), images, PROMPT, 24)
    assert len(set(want)) > 3
    paths = []
    for k, im in enumerate(images):
        paths += ["--image", str(bundle.tmp / f"im{k}.png")]
        im.save(paths[-1])
    for mode in ("kv", "hybrid"):
        got = cli_json(capsys, bundle.bundle, *paths, "--prompt", PROMPT, "--mode", mode, "--max-new-tokens", 24,
                       "--ignore-eos")
        assert got["prompt_tokens"] == len(ids) and got["token_ids"] == want, mode


def test_manifest_rows_are_wider_than_hidden(bundle):
    """The token table, the vision graph's rows and the decoder's inputs are hidden + layers × per_layer wide."""
    from fixtures_gemma4 import TEXT

    m = bundle.manifest()
    width = TEXT["hidden_size"] + TEXT["num_hidden_layers"] * TEXT["hidden_size_per_layer_input"]
    assert m["decoder"]["hidden_size"] == width
    assert np.load(bundle.bundle / "embed.npy", mmap_mode="r").shape[1] == width
    assert [layer["kind"] for layer in m["kv"]["layers"]] == ["sliding_attention", "sliding_attention", "attention",
                                                              "sliding_attention", "shared_kv", "shared_kv"]


def test_hub_config_form_gives_the_same_family_config(bundle):
    """The hub writes global_head_dim / num_global_key_value_heads where transformers' save writes per_layer_config:
    both give the same layer shapes."""
    from fixtures_gemma4 import TEXT
    from vlmrt.families import family_for

    saved = json.loads((bundle.ckpt / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    hub = json.loads(json.dumps(saved))
    del hub["text_config"]["per_layer_config"]
    hub["text_config"].update(global_head_dim=TEXT["global_head_dim"],
                              num_global_key_value_heads=TEXT["num_global_key_value_heads"])
    fam = family_for(saved)
    assert fam.config(hub).text.shapes == fam.config(saved).text.shapes
    assert {s.head_dim for s in fam.config(saved).text.shapes} == {16, 32}


def test_bidirectional_vision_attention_is_refused_in_one_line(bundle, tmp_path, capsys):
    """use_bidirectional_attention "vision" (transformers: an image token sees its whole image on the sliding
    layers during prefill) would answer differently from a causal decoder: `vlmrt export` refuses it, one line,
    nothing written."""
    from vlmrt import cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(bundle.ckpt, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (ckpt / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()  # (the progress line, then the error)
    assert err[-1].startswith("vlmrt: error: Gemma 4 use_bidirectional_attention 'vision'")
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "out").exists()


def test_weight_only_precision_keeps_a_float16_table(bundle, tmp_path, capsys):
    """A weight-only precision quantizes the graphs but keeps the token table float16 when its rows carry per-layer
    rows (as int8 rows they lose the answers: docs/gemma4.md, the table benchmark): the fp32 bundle's table in
    float16, no scales, no int8 token-row inputs; the bundle answers (on main 9ee29fd the export was refused)."""
    from family_runner import cli_json
    from vlmrt import cli

    out = tmp_path / "w8a16"
    assert cli.main(["export", str(bundle.ckpt), str(out), "--quant", "w8a16"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["decoder"]["embedding_dtype"] == "float16" and not m["decoder"].get("embedding_scale_file")
    assert not m["decoder"]["kind"].get("token_rows_input")
    table = np.load(out / "embed.npy")
    assert np.array_equal(table, np.load(bundle.bundle / "embed.npy").astype(np.float16))
    got = cli_json(capsys, out, "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos")
    assert len(got["token_ids"]) == 24


def test_audio_tower_checkpoint_loads_vision_and_text(tmp_path):
    """A checkpoint with an audio tower: its audio weights are left out, its vision and text load as the contract
    checks them (every other weight mapped)."""
    from safetensors.torch import load_file

    from fixtures_gemma4 import make_gemma4_checkpoint
    from vlmrt.families import family_for

    ckpt = make_gemma4_checkpoint(tmp_path / "audio", audio=True)
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert any(k.startswith("model.audio_tower.") for k in tensors)
    fam = family_for(config)
    cfg = fam.config(config)
    assert cfg.audio
    from vlmrt.families.checkpoint import Checkpoint

    fam.host(Checkpoint.open(ckpt), cfg, json.loads((ckpt / "tokenizer.json").read_text()))
    weights = fam.weights(cfg, tensors)
    assert weights.embed.shape[1] == cfg.text.row_width
