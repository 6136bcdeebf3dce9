"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 (`model_type` qwen2_5_vl, qwen3_vl, qwen3_5): native-resolution ViT + 2×2 patch
merger + a Qwen2-like (2.5) or Qwen3-like (3, q/k norm) decoder with M-RoPE; Qwen3-VL adds DeepStack; Qwen3.5 takes
Qwen3-VL's tower without DeepStack, its processor, and a decoder of its own (gated_delta.py: Gated DeltaNet layers with a
recurrent state beside gated attention layers).

One module per part (nanoVLM): config.py (the config dataclasses from config.json), vision.py (the two vision towers
as static graphs fed by host-computed inputs, runtime/media/vision_inputs.py `native_grid`; the mergers and DeepStack's
mergers with them), language.py (the decoder: layers.CausalDecoder with M-RoPE rows and DeepStack's row input),
processing.py (the processor files -> the image op runtime/media/image_native.py "smart_resize" and the patch budget).
What the runtime runs is in the manifest: tiling smart_resize, prompt expansion wrapped_run, positions op mrope (3
rows), vision.tile_inputs native_grid, vision.row_outputs + decoder.row_input (DeepStack).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import Family, HostSpec, Weights
from ..decoder import UnsupportedCheckpoint
from . import gated_delta, language, vision
from .config import MODEL_TYPES, QwenVLConfig
from .processing import image_spec

# the prompt text of an image (Qwen2VLProcessor): the chat template writes START IMAGE END per image item, the
# processor repeats IMAGE once per merge block (the runtime's wrapped_run)
TOKENS = {"start_token": "<|vision_start|>", "image_token": "<|image_pad|>", "end_token": "<|vision_end|>"}


def config_from_hf(config: dict[str, Any]) -> QwenVLConfig:
    return QwenVLConfig.from_hf(config)


def load_weights(cfg: QwenVLConfig, tensors) -> Weights:
    from ..weights import Tensors

    t = Tensors(tensors)
    tower = vision.StaticTower(vision.load(cfg.vision, tensors, t.take), cfg.vision)
    if cfg.kind == "qwen3_5":
        for name in tensors:  # the multi-token-prediction head: unused here, as transformers leaves it (mtp.*)
            if name.startswith("mtp."):
                t.take(name)
        dec, embed = gated_delta.load(cfg, tensors, t.take, language.text_prefix(tensors))
    else:
        dec, embed = language.load(cfg, tensors, t.take)
    t.check_all_used()
    return Weights(tower, dec, embed)


def _token(tok_json: dict, token_id: int, want: str) -> str:
    """The added token of that id, checked to be the processor's string."""
    for t in tok_json.get("added_tokens", []):
        if t["id"] == token_id:
            if t["content"] != want:
                raise UnsupportedCheckpoint(f"the tokenizer's token {token_id} is {t['content']!r}, not {want!r}")
            return want
    raise UnsupportedCheckpoint(f"the tokenizer has no added token {want!r} (id {token_id} in config.json)")


def host_spec(ckpt, cfg: QwenVLConfig, tok_json: dict) -> HostSpec:
    """Qwen2VLImageProcessor (its settings required, in either layout: families/checkpoint.py; smart_resize under the
    patch budget) + Qwen2_5_VLProcessor / Qwen3VLProcessor's image
    text (wrapped_run: one image token per merge block between the vision markers), its tower's host inputs
    (native_grid) and M-RoPE positions (mrope, 3 rows)."""
    processor = "Qwen2_5_VLProcessor" if ckpt.config.get("model_type") == "qwen2_5_vl" else "Qwen3VLProcessor"
    image = image_spec(ckpt.require_image_processor(processor), cfg.vision, cfg.max_patches or None)
    tokens = {"start_token": _token(tok_json, cfg.vision_start_token_id, TOKENS["start_token"]),
              "image_token": _token(tok_json, cfg.image_token_id, TOKENS["image_token"]),
              "end_token": _token(tok_json, cfg.vision_end_token_id, TOKENS["end_token"])}
    ops, params = vision.host_inputs(cfg.vision)
    return HostSpec(image=image, prompt_expansion="wrapped_run", prompt_params=tokens,
                    image_placeholder=tokens["start_token"] + tokens["image_token"] + tokens["end_token"],
                    image_token_id=cfg.image_token_id, positions_op="mrope", positions_rows=3,
                    tile_inputs="native_grid",
                    tile_params={"ops": ops, **params, "mask_value": float(np.finfo(np.float32).min)})


def default_max_context(cfg: QwenVLConfig, host: HostSpec) -> tuple[int, str]:
    """Room for two images at the patch budget and 1024 tokens of text, rounded up to 256."""
    tokens = host.image.params["max_patches"] // cfg.vision.merge_unit
    ctx = -(-(2 * tokens + 1024) // 256) * 256
    return ctx, f"2 images × {tokens} image tokens (the patch budget) + 1024 for text"


FAMILY = Family(name="qwen_vl", model_types=MODEL_TYPES, config_from_hf=config_from_hf, load_weights=load_weights,
                host_spec=host_spec, default_max_context=default_max_context)
