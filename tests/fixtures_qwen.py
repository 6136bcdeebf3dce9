"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints built from transformers 5.24's config classes (Qwen2_5_VLConfig,
Qwen3VLConfig), weights re-drawn so activations are O(1) (the default init is nearly flat), saved with
save_pretrained: the checkpoints' own weight layouts (Qwen2.5-VL: visual.* + model.layers.*; Qwen3-VL: model.visual.*
+ model.language_model.*)."""

from __future__ import annotations

import math
from pathlib import Path

# (vision config, text config) per model type: small, but every feature on — Qwen2.5-VL windows of 2×2 merge blocks
# (window_size 56 px at 14 px patches) and full attention on blocks 1 and 3; Qwen3-VL a 6×6 position table and
# DeepStack after blocks 0, 1, 2; M-RoPE sections of a 16-wide head
TINY = {
    "qwen2_5_vl": (
        dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
             fullatt_block_indexes=[1, 3], patch_size=14),
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
    ),
    "qwen3_vl": (
        dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=36,
             deepstack_visual_indexes=[0, 1, 2], patch_size=16),
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                              "mrope_interleaved": True}),
    ),
}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 1000, 1001, 1002, 1003
EOS_ID = 3


def make_model(kind: str, seed: int = 0):
    """The tiny model in fp32, eval mode, weights re-drawn from seed."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)

    vision, text = TINY[kind]
    cls, cfg_cls = ((Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig) if kind == "qwen2_5_vl"
                    else (Qwen3VLForConditionalGeneration, Qwen3VLConfig))
    cfg = cfg_cls(vision_config=vision, text_config={**text, "bos_token_id": None, "eos_token_id": EOS_ID},
                  image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                  vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    redraw(model, seed)
    return model


def redraw(model, seed: int) -> None:
    """Every parameter re-drawn: >= 2-D N(0, 1/fan_in) (an Embedding's rows and the position table N(0, 0.5²)),
    norm weights 1 + 0.1 N, biases 0.1 N."""
    import torch

    g = torch.Generator().manual_seed(seed + 777)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pos_embed.weight") or "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(math.prod(p.shape[1:])))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_checkpoint(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """The tiny model saved as a checkpoint folder (config.json + model.safetensors)."""
    make_model(kind, seed).save_pretrained(out_dir)
    return out_dir


_LOADED: dict = {}


def loaded(kind: str, tmp_path_factory):
    """(config, transformers' model, our vision tower, our decoder, embedding table, checkpoint folder) for kind, built
    once per test session (both test modules share it); every checkpoint weight is checked to be read."""
    if kind in _LOADED:
        return _LOADED[kind]
    import json

    from safetensors.torch import load_file

    from vlmrt.families.qwen_vl import language, vision
    from vlmrt.families.qwen_vl.config import QwenVLConfig

    ckpt = make_checkpoint(kind, tmp_path_factory.mktemp(kind))
    cfg = QwenVLConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    tensors = load_file(str(ckpt / "model.safetensors"))
    used = set()

    def take(name):
        used.add(name)
        return tensors[name]

    tower = vision.load(cfg.vision, tensors, take)
    assert used == {n for n in tensors if "visual." in n}  # the tower reads every vision weight
    dec, embed = language.load(cfg, tensors, take, positions=512)
    assert used == set(tensors), sorted(set(tensors) - used)[:3]  # and the decoder the rest
    _LOADED[kind] = (cfg, make_model(kind), tower, dec, embed, ckpt)
    return _LOADED[kind]


_VISION_GRAPHS: dict = {}


def vision_graph(kind: str, tmp_path_factory, rows: int):
    """Our tower exported as one static ONNX graph of `rows` patch rows (export/graphs.py export_graph, fp32), as an
    ORT session; once per session and size."""
    if (kind, rows) in _VISION_GRAPHS:
        return _VISION_GRAPHS[kind, rows]
    import onnxruntime as ort

    from vlmrt.export.graphs import export_graph
    from vlmrt.families.qwen_vl import vision

    cfg, _, tower, *_ = loaded(kind, tmp_path_factory)
    v = cfg.vision
    path = tmp_path_factory.mktemp(f"{kind}-vision") / "vision.onnx"
    export_graph(tower, vision.example_inputs(v, rows, -1e30), vision.input_names(v), vision.output_names(v), path)
    _VISION_GRAPHS[kind, rows] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return _VISION_GRAPHS[kind, rows]
