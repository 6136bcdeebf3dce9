"""Gemma 4 (E2B / E4B, issue 45; docs/gemma4.md): config.py (the text config both ways configs are written, the
VLM's config), language.py (the decoder: sliding-window, full and kv-shared layers, per-layer inputs in the token
rows), vision.py (the tower + embedder as one static graph over a patch budget). transformers 5.24's
Gemma4ForConditionalGeneration / Gemma4Processor are the reference.

The host: Gemma4ImageProcessor's aspect-ratio patches (pooled_aspect, pooled_positions: runtime/media/image_pooled.py)
and Gemma4Processor's image text, `<boi>` + the image token × the image's soft tokens + `<eoi>` (wrapped_run). A
checkpoint with an audio tower exports its vision and text (the audio weights are left out); vlmrt takes no audio
input.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import Family, HostSpec, Weights, processor_image
from ..decoder import UnsupportedCheckpoint
from ..weights import Tensors
from . import language, vision
from .config import Gemma4Config

MODEL_TYPES = ("gemma4",)
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
SOFT_TOKENS = (70, 140, 280, 560, 1120)  # Gemma4ImageProcessor's allowed max_soft_tokens


def config_from_hf(config: dict[str, Any]) -> Gemma4Config:
    return Gemma4Config.from_hf(config)


def load_weights(cfg: Gemma4Config, tensors: dict[str, torch.Tensor]) -> Weights:
    """(vision graph module, decoder, token table [vocab, hidden + layers × per_layer]); every weight mapped but the
    audio tower's."""
    take = Tensors(tensors)
    t = cfg.text
    decoder, table = language.load(t, take, "model.language_model.")
    pad_rows = torch.from_numpy(table.rows(t.pad_id, t.pad_id + 1)[0, t.hidden:])
    tower = vision.load(cfg.vision_config, take, "model.", t.hidden, pad_rows,
                        cfg.patches_per_tile)
    take.check_all_used(skip=lambda name: name.startswith(AUDIO_PREFIXES))
    return Weights(tower, decoder, table)


def host_spec(ckpt, cfg: Gemma4Config, tok_json: dict) -> HostSpec:
    """Gemma4ImageProcessor's settings (required, either layout; its class defaults for what they leave out) as the
    pooled_aspect tiling's parameters and Gemma4Processor's image text as wrapped_run. Fixes cfg.max_soft_tokens, the
    vision graph's budget."""
    pp = ckpt.require_image_processor("Gemma4Processor")
    soft, kernel, patch = (int(pp.get("max_soft_tokens", 280)), int(pp.get("pooling_kernel_size", 3)),
                           int(pp.get("patch_size", 16)))
    if soft not in SOFT_TOKENS:
        raise UnsupportedCheckpoint(f"the image processor's max_soft_tokens {soft} is not one of "
                                    f"{', '.join(map(str, SOFT_TOKENS))}")
    if kernel != cfg.kernel or patch != cfg.vision.patch_size:
        raise UnsupportedCheckpoint(f"the image processor's pooling_kernel_size {kernel} / patch_size {patch} are not "
                                    f"the vision tower's {cfg.kernel} / {cfg.vision.patch_size}")
    cfg.max_soft_tokens = soft
    normalize = pp.get("do_normalize", False)
    image = processor_image(pp if normalize else {**pp, "image_mean": [0.0] * 3, "image_std": [1.0] * 3},
                            tiling="pooled_aspect", tile_size=kernel * patch, patch_size=patch,
                            params={"max_soft_tokens": soft, "pooling_kernel": kernel}, resample=3,
                            mean=[0.0] * 3, std=[1.0] * 3)
    names = {v: k for k, v in _vocab(tok_json).items()}
    tokens = {}
    for role, tid in (("start_token", cfg.boi_token_id), ("image_token", cfg.image_token_id),
                      ("end_token", cfg.eoi_token_id)):
        if tid not in names:
            raise UnsupportedCheckpoint(f"the tokenizer has no token {tid} (config.json's {role.split('_')[0]} marker)")
        tokens[role] = names[tid]
    return HostSpec(image=image, prompt_expansion="wrapped_run", prompt_params=tokens,
                    image_placeholder=tokens["image_token"], image_token_id=cfg.image_token_id,
                    tile_inputs="pooled_positions", tile_params={"pooling_kernel": kernel})


def _vocab(tok_json: dict) -> dict[str, int]:
    vocab = dict(tok_json.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok_json.get("added_tokens", [])})
    return vocab


def default_max_context(cfg: Gemma4Config, host: HostSpec) -> tuple[int, str]:
    tokens = cfg.max_soft_tokens + 2
    ctx = -(-(2 * tokens + 1024) // 256) * 256
    return ctx, f"2 images × {tokens} tokens (max_soft_tokens and the markers) + 1024 for text"


FAMILY = Family(name="gemma4", model_types=MODEL_TYPES, config_from_hf=config_from_hf, load_weights=load_weights,
                host_spec=host_spec, default_max_context=default_max_context)
