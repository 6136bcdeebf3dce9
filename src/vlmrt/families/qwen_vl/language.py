"""The Qwen2.5-VL / Qwen3-VL decoder: the Qwen2 / Qwen3 layers of families/decoder.py as a layers.CausalDecoder
built with two options from the config: M-RoPE (`rope_rows`: each rotary frequency's angle from one of 3 position
rows, which runtime/prompt/positions.py's `mrope` op computes on the host) and DeepStack (Qwen3-VL, `row_levels`: vision
features added to the image tokens' hidden states after decoder layers 0 .. levels-1, fed as the per-token row input).

forward(inputs_embeds [ar, hidden], position_ids [3, ar] int64, [row_input [ar, levels*hidden] (Qwen3-VL; zero rows
        for text tokens)], *step (the attention kind's), *past) -> (logits, new rows...)  — families/layers.py
"""

from __future__ import annotations

import torch

from .. import decoder, layers
from ..decoder import UnsupportedCheckpoint
from .config import QwenVLConfig


def text_prefix(tensors) -> str:
    """Where the decoder's weights are: `model.language_model.` (Qwen3-VL, transformers 5) or `model.` (Qwen2.5-VL's
    hub layout)."""
    if any(n.startswith("model.language_model.") for n in tensors):
        return "model.language_model."
    if any(n.startswith("model.layers.") for n in tensors):
        return "model."
    raise UnsupportedCheckpoint("checkpoint has no decoder weights (model.language_model.* or model.layers.*)")


def deepstack_levels(cfg: QwenVLConfig) -> int:
    return len(cfg.vision.deepstack_layers)


def load(cfg: QwenVLConfig, tensors, take, positions: int = 4096) -> tuple[layers.CausalDecoder, torch.Tensor]:
    """(the decoder with M-RoPE and DeepStack, embedding table [vocab, hidden]); positions: rows of the rope table
    (the export sizes it again to the max context)."""
    head = None if cfg.tie_word_embeddings else "lm_head.weight"
    plain, embed = decoder.load(cfg.text, tensors, take, text_prefix(tensors), head)
    dec = layers.CausalDecoder(**{**plain.shape, "rope_rows": tuple(cfg.mrope.rows()), "row_levels": deepstack_levels(cfg)})
    dec.load_state_dict(plain.state_dict())
    dec.rope_table(positions)
    return dec.eval(), embed
