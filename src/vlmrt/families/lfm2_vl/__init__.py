"""LFM2-VL (LiquidAI LFM2-VL-450M / 1.6B): SigLIP2 NaFlex vision tower + pixel-unshuffle projector + LFM2, a hybrid
decoder of gated short-convolution layers and a few attention layers.

One module per part: config.py (Lfm2VlConfig from config.json), vision.py (the vision graph), language.py (the
decoder, its conv state beside the KV cache). transformers 5.24's Lfm2VlForConditionalGeneration is the reference.
Weights load by prefix: our module names are the checkpoint's below `model.vision_tower.`,
`model.multi_modal_projector.` and `model.language_model.`, but for the SigLIP2 layers' (a table).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .. import Family, HostSpec, Weights, processor_image
from ..decoder import UnsupportedCheckpoint
from ..weights import Tensors
from . import language
from .config import Lfm2VlConfig
from .vision import NaFlexVision

MODEL_TYPES = ("lfm2_vl",)

VISION_LAYER_KEYS = {  # under model.vision_tower.encoder.layers.{i}. -> layers.{i}.
    "layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.out_proj": "out_proj",
    "mlp.fc1": "fc1", "mlp.fc2": "fc2",
}


def config_from_hf(config: dict[str, Any]) -> Lfm2VlConfig:
    return Lfm2VlConfig.from_hf(config)


def load_vision(cfg: Lfm2VlConfig, take: Callable[[str], torch.Tensor], prefix: str = "model.") -> NaFlexVision:
    """The vision graph's module from the checkpoint's tensors (take(name) fetches one and records it as used)."""
    vp, pp = prefix + "vision_tower.", prefix + "multi_modal_projector."
    vision = NaFlexVision(cfg)
    sd = {
        "patch_embedding.weight": take(vp + "embeddings.patch_embedding.weight"),
        "patch_embedding.bias": take(vp + "embeddings.patch_embedding.bias"),
        "position_embedding": take(vp + "embeddings.position_embedding.weight"),
        "post_layernorm.weight": take(vp + "post_layernorm.weight"),
        "post_layernorm.bias": take(vp + "post_layernorm.bias"),
    }
    for i in range(cfg.vision.layers):
        for src, dst in VISION_LAYER_KEYS.items():
            for p in ("weight", "bias"):
                sd[f"layers.{i}.{dst}.{p}"] = take(f"{vp}encoder.layers.{i}.{src}.{p}")
    names = ["linear_1", "linear_2"] + (["layer_norm"] if cfg.projector_layernorm else [])
    for name in names:
        for p in ("weight", "bias") if (cfg.projector_bias or name == "layer_norm") else ("weight",):
            sd[f"projector.{name}.{p}"] = take(f"{pp}{name}.{p}")
    if sd["patch_embedding.weight"].shape[1] != 3 * cfg.vision.patch_size**2:
        raise UnsupportedCheckpoint(f"patch embedding takes {sd['patch_embedding.weight'].shape[1]} values per patch, "
                                    f"not 3 × {cfg.vision.patch_size}²")
    vision.load_state_dict(sd, strict=True)
    return vision.eval()


def load_weights(cfg: Lfm2VlConfig, tensors: dict[str, torch.Tensor]) -> Weights:
    """(vision graph module, decoder, embedding table [vocab, hidden]); every checkpoint weight mapped."""
    take = Tensors(tensors)
    vision = load_vision(cfg, take)
    head = "lm_head.weight"
    if not cfg.tie_word_embeddings and head not in tensors:
        raise UnsupportedCheckpoint(f"config says the lm head is not tied, but the checkpoint has no {head}")
    decoder, embed = language.load(cfg.text, take, "model.language_model.", head if head in tensors else None)
    take.check_all_used()
    return Weights(vision, decoder, embed)


def host_spec(ckpt, cfg: Lfm2VlConfig, tok_json: dict) -> HostSpec:
    """Lfm2VlImageProcessor's settings (required, in either layout: families/checkpoint.py; its class defaults for
    the keys they leave out) as the
    naflex_tiles op's parameters, the naflex_rows tile inputs (the position table's side, the downsample factor,
    the key mask's value), Lfm2VlProcessor's image text as tile_markers. Fixes cfg.max_patches, the vision graph's
    rows per tile (the processor's max_num_patches): the accessors run config, host, then weights."""
    pp = ckpt.require_image_processor("Lfm2VlProcessor")
    tc = ckpt.named_tokens()
    f = pp.get("downsample_factor", 2)
    patch = pp.get("encoder_patch_size", 16)
    if f != cfg.downsample_factor or patch != cfg.vision.patch_size:
        raise UnsupportedCheckpoint(f"the image processor's downsample_factor {f} / encoder_patch_size {patch} are not "
                                    f"the model's {cfg.downsample_factor} / {cfg.vision.patch_size}")
    tile, split = pp.get("tile_size", 512), pp.get("do_image_splitting", True)
    params = {"downsample_factor": f, "min_tiles": pp.get("min_tiles", 2), "max_tiles": pp.get("max_tiles", 10),
              "use_thumbnail": pp.get("use_thumbnail", True), "min_image_tokens": pp.get("min_image_tokens", 64),
              "max_image_tokens": pp.get("max_image_tokens", 256),
              "max_pixels_tolerance": pp.get("max_pixels_tolerance", 2.0), "split": split}
    # Lfm2VlImageProcessor.__init__: the larger of a thumbnail's and a tile's patches
    params["max_num_patches"] = max(params["max_image_tokens"] * f * f, (tile // patch) ** 2 if split else 0)
    cfg.max_patches = params["max_num_patches"]
    image = processor_image(pp, tiling="naflex_tiles", tile_size=tile, patch_size=patch, params=params, resample=2,
                            mean=[0.5] * 3, std=[0.5] * 3)  # (bilinear; IMAGENET_STANDARD_MEAN / STD)
    tokens = {"image_token": tc.get("image_token", "<image>"), "start_token": tc.get("image_start_token", "<|image_start|>"),
              "end_token": tc.get("image_end_token", "<|image_end|>"),
              "thumbnail_token": tc.get("image_thumbnail_token", "<|img_thumbnail|>"),
              "tile_marker": "<|img_row_{row}_col_{col}|>"}
    # transformers' eager attention masks padding keys with the dtype's lowest (float32 I/O: the graph's edge)
    tile_params = {"position_side": cfg.vision.position_side, "downsample_factor": f,
                   "mask_value": float(np.finfo(np.float32).min)}
    return HostSpec(image=image, prompt_expansion="tile_markers", prompt_params=tokens,
                    image_placeholder=tokens["image_token"], image_token_id=cfg.image_token_id,
                    tile_inputs="naflex_rows", tile_params=tile_params)


def default_max_context(cfg: Lfm2VlConfig, host: HostSpec) -> tuple[int, str]:
    p = host.image.params
    tiles = p["max_tiles"] * cfg.tokens_per_tile + p["max_image_tokens"]
    ctx = max(1024, 512 * -(-(tiles + 512) // 512))
    return ctx, (f"vlmrt's default for LFM2-VL: {p['max_tiles']} tiles + a thumbnail ({tiles} image tokens) and "
                 "512 of text, in multiples of 512")


FAMILY = Family(name="lfm2_vl", model_types=MODEL_TYPES, config_from_hf=config_from_hf, load_weights=load_weights,
                host_spec=host_spec, default_max_context=default_max_context)
