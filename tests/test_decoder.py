"""The text decoders (families/decoder.py, layers.CausalDecoder) against transformers on the same weights: scaled RoPE
types, attention / MLP biases, a saved lm head under a tied config — each exported from a tiny checkpoint of the
family whose decoder has it (Llama: SmolVLM; Qwen3: InternVL3.5), greedy ids and teacher-forced logits compared in
both modes (oracle.text_equals_transformers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vlmrt import cli

pytest.importorskip("transformers")

PROMPT = "What is in the image? Describe the colours."


ROPE_SCALING = {  # transformers' rope_parameters (modeling_rope_utils.py) of the types a fixed RoPE table holds
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALING))
def test_rope_scaling_equals_transformers(kind, tmp_path, capsys):
    """Scaled RoPE (linear, Llama 3.1's, YaRN with its attention factor on cos/sin: families/rope.py) gives
    transformers' greedy ids and logits (measured max |diff| ~8e-6 of ~4), where plain RoPE of the same theta
    moves the logits by > 0.01; dynamic NTK past max_position_embeddings (frequencies that change with the length)
    is refused at export in one line."""
    import shutil

    import torch
    from fixtures import SMOLVLM, load_hf_model, make_smolvlm_checkpoint
    from oracle import text_equals_transformers

    rope = {**ROPE_SCALING[kind], "rope_theta": 10000.0}
    ckpt = make_smolvlm_checkpoint(tmp_path / "ckpt", text_overrides={"rope_parameters": rope})
    assert cli.main(["export", str(ckpt), str(tmp_path / "b"), "--prefill-ar", "8", "--max-seq-len", "96", "--quiet"]) == 0
    seq, ref = text_equals_transformers(SMOLVLM, ckpt, tmp_path / "b", PROMPT)
    plain = tmp_path / "plain"  # the same weights with plain RoPE
    shutil.copytree(ckpt, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        other = load_hf_model(plain)(input_ids=torch.tensor([seq])).logits[0, -len(ref) - 1:-1].numpy()
    assert np.abs(other - ref).max() > 0.01
    if kind == "linear":
        cfg["text_config"].update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                  max_position_embeddings=64)
        (plain / "config.json").write_text(json.dumps(cfg))
        capsys.readouterr()
        assert cli.main(["export", str(plain), str(tmp_path / "d"), "--max-seq-len", "96", "--quiet"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("vlmrt: error: dynamic RoPE") and not (tmp_path / "d").exists()


@pytest.mark.parametrize("decoder, text", [("llama", {"attention_bias": True, "mlp_bias": True}),
                                           ("qwen3", {"attention_bias": True, "head_dim": 16})],
                         ids=["llama-attention-mlp-bias", "qwen3-attention-bias"])
def test_decoder_biases_equal_transformers(decoder, text, tmp_path):
    """attention_bias (Llama, Qwen3: q/k/v and o_proj) and mlp_bias (Llama: gate/up/down) decoders give
    transformers' greedy ids and logits (measured max |diff| ~6e-6 of ~4; refused before as unmapped weights)."""
    from fixtures import SMOLVLM, make_smolvlm_checkpoint
    from fixtures_internvl import INTERNVL, make_internvl_checkpoint
    from oracle import text_equals_transformers
    from safetensors import safe_open

    if decoder == "llama":
        fam, ckpt = SMOLVLM, make_smolvlm_checkpoint(tmp_path / "ckpt", text_overrides=text)
    else:
        fam, ckpt = INTERNVL, make_internvl_checkpoint(tmp_path / "ckpt", decoder=decoder, text_overrides=text)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        biases = {k.rsplit(".", 2)[-2] for k in f.keys() if k.endswith("_proj.bias") and ".layers.0." in k
                  and "vision" not in k}
    assert biases == ({"q_proj", "k_proj", "v_proj", "o_proj"} | ({"gate_proj", "up_proj", "down_proj"}
                                                               if decoder == "llama" else set()))
    assert cli.main(["export", str(ckpt), str(tmp_path / "b"), "--prefill-ar", "8", "--max-seq-len", "96", "--quiet"]) == 0
    text_equals_transformers(fam, ckpt, tmp_path / "b", PROMPT)


@pytest.mark.parametrize("family", ["smolvlm", "internvl"])
def test_saved_lm_head_under_tied_config_is_the_head(family, tmp_path):
    """A checkpoint whose config says tie_word_embeddings but that saves an lm_head of its own: transformers 5 does
    not tie them and uses the saved head; so does the export (it used the embedding table: other greedy ids, logits
    ~5 apart)."""
    import torch
    from fixtures import SMOLVLM, make_smolvlm_checkpoint
    from fixtures_internvl import INTERNVL, make_internvl_checkpoint
    from oracle import text_equals_transformers
    from safetensors.torch import load_file, save_file

    if family == "smolvlm":
        fam, ckpt, key = SMOLVLM, make_smolvlm_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True), "lm_head.weight"
    else:
        fam, key = INTERNVL, "language_model.lm_head.weight"
        ckpt = make_internvl_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    sd = load_file(str(ckpt / "model.safetensors"))
    assert key not in sd
    emb = next(t for k, t in sd.items() if k.endswith("embed_tokens.weight"))
    sd[key] = (emb + 0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))).contiguous()
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True
    assert cli.main(["export", str(ckpt), str(tmp_path / "b"), "--prefill-ar", "8", "--max-seq-len", "96", "--quiet"]) == 0
    text_equals_transformers(fam, ckpt, tmp_path / "b", PROMPT)
