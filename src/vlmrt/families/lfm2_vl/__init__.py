"""LFM2-VL (LiquidAI LFM2-VL-450M / 1.6B): SigLIP2 NaFlex vision tower + pixel-unshuffle projector + LFM2, a hybrid
decoder of gated short-convolution layers and a few attention layers.

One module per part: config.py (Lfm2VlConfig from config.json), vision.py (the vision graph), language.py (the
decoder, its conv state beside the KV cache). transformers 5.24's Lfm2VlForConditionalGeneration is the reference.
Weights load by prefix: our module names are the checkpoint's below `model.vision_tower.`,
`model.multi_modal_projector.` and `model.language_model.`, but for the SigLIP2 layers' (a table).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..decoder import UnsupportedCheckpoint
from .config import Lfm2VlConfig
from .vision import NaFlexVision

MODEL_TYPES = ("lfm2_vl",)

VISION_LAYER_KEYS = {  # under model.vision_tower.encoder.layers.{i}. -> layers.{i}.
    "layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2", "self_attn.q_proj": "q_proj",
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
