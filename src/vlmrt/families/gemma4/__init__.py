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
from ...runtime.media.video import MAX_SOURCE_FRAMES  # ("every frame": do_sample_frames false)
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
    soft, kernel, patch = _pooling(pp, "image", 280, cfg)
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
                    tile_inputs="pooled_positions", tile_params={"pooling_kernel": kernel},
                    video=video_spec(ckpt, cfg, names, image))


# Gemma4Processor writes a video's frames with this token (processing_gemma4.py: "<|video|>", added to the tokenizer
# when it lacks it), each as "MM:SS <boi><|video|>×n<eoi>", frames joined by a space
VIDEO_TOKEN = "<|video|>"


def video_spec(ckpt, cfg: Gemma4Config, names: dict[int, str], image) -> dict[str, Any] | None:
    """Gemma4VideoProcessor's settings (Checkpoint.video_processor, as transformers reads them; its class defaults
    for what they leave out: 32 frames, 70 soft tokens a frame, bicubic, x / 255) as the manifest's video spec:
    transformers' default sampling ("uniform": num_frames, or fps), each frame tiled as an image at the video's
    budget with torchvision's resize ("pooled_aspect_tensor", padded to the vision graph's budget), and
    Gemma4Processor's frame text. None (the bundle refuses videos) where the tokenizer has no `<|video|>` at
    config.json's video_token_id (transformers would add one the model has no row for)."""
    if names.get(cfg.video_token_id) != VIDEO_TOKEN:
        return None
    vp = ckpt.video_processor() or {}
    soft, kernel, patch = _pooling(vp, "video", 70, cfg)
    if soft > cfg.max_soft_tokens:
        raise UnsupportedCheckpoint(f"the video processor's max_soft_tokens {soft} is over the image processor's "
                                    f"{cfg.max_soft_tokens} (the vision graph's budget)")
    fps, frames = vp.get("fps"), vp.get("num_frames", 32)
    if fps is not None and frames is not None:
        raise UnsupportedCheckpoint("the video processor sets both fps and num_frames (transformers refuses both: "
                                    "`num_frames` and `fps` are mutually exclusive)")
    if not vp.get("do_sample_frames", True):
        fps, frames = None, None  # every frame
    normalize = vp.get("do_normalize", True)  # (Gemma4VideoProcessor's default, over mean 0 / std 1)
    frame = processor_image(vp if normalize else {**vp, "image_mean": [0.0] * 3, "image_std": [1.0] * 3},
                            tiling="pooled_aspect_tensor", tile_size=kernel * patch, patch_size=patch,
                            params={"max_soft_tokens": soft, "pooling_kernel": kernel,
                                    "graph_patches": cfg.patches_per_tile},
                            resample=3, mean=[0.0] * 3, std=[1.0] * 3)
    return {"fps": float(fps or 0), "max_frames": int(frames or MAX_SOURCE_FRAMES), "placeholder": VIDEO_TOKEN,
            "frame_line": "{timestamp} ", "separator": " ", "sampling": "uniform", "frames": "image_tiling",
            "frame_image": frame, "frame_params": {"image_token": VIDEO_TOKEN}, "frame_token_id": cfg.video_token_id}


def _vocab(tok_json: dict) -> dict[str, int]:
    vocab = dict(tok_json.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok_json.get("added_tokens", [])})
    return vocab


def default_max_context(cfg: Gemma4Config, host: HostSpec) -> tuple[int, str]:
    """2 images at the budget, or one video of the video processor's frames (32 where it samples by fps or takes
    every frame) at its
    budget with the markers and ~6 tokens of timestamp, whichever is more, + 1024 of text."""
    tokens = cfg.max_soft_tokens + 2
    media, why = 2 * tokens, f"2 images × {tokens} tokens (max_soft_tokens and the markers)"
    if host.video is not None:
        count = not host.video["fps"] and host.video["max_frames"] < MAX_SOURCE_FRAMES
        frames = host.video["max_frames"] if count else 32
        each = host.video["frame_image"].params["max_soft_tokens"] + 2 + 6
        if frames * each > media:
            media, why = frames * each, f"a video of {frames} frames × {each} tokens (soft tokens, markers, timestamp)"
    return -(-(media + 1024) // 256) * 256, why + " + 1024 for text"


FAMILY = Family(name="gemma4", model_types=MODEL_TYPES, config_from_hf=config_from_hf, load_weights=load_weights,
                host_spec=host_spec, default_max_context=default_max_context)


def _pooling(settings: dict, which: str, default_soft: int, cfg) -> tuple[int, int, int]:
    """(max_soft_tokens, pooling kernel, patch) of the image or video processor's settings: the budget one of
    SOFT_TOKENS, the kernel and patch the tower's (UnsupportedCheckpoint naming the field otherwise)."""
    soft, kernel, patch = (int(settings.get("max_soft_tokens", default_soft)),
                           int(settings.get("pooling_kernel_size", 3)), int(settings.get("patch_size", 16)))
    if soft not in SOFT_TOKENS:
        raise UnsupportedCheckpoint(f"the {which} processor's max_soft_tokens {soft} is not one of "
                                    f"{', '.join(map(str, SOFT_TOKENS))}")
    if kernel != cfg.kernel or patch != cfg.vision.patch_size:
        raise UnsupportedCheckpoint(f"the {which} processor's pooling_kernel_size {kernel} / patch_size {patch} are "
                                    f"not the vision tower's {cfg.kernel} / {cfg.vision.patch_size}")
    return soft, kernel, patch
