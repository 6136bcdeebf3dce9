"""SmolVLM / Idefics3: SigLIP vision tower + pixel-shuffle connector + Llama (SmolLM2) decoder.

Mirrors transformers/models/smolvlm/modeling_smolvlm.py (and idefics3, which it copies), written
for static shapes: the vision graph takes one full tile as host-unfolded patches, the decoder
graphs take embeddings (the host looks up and splices them) and an external KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import Family, HostSpec, VisionModule, Weights, processor_image, resample_name
from .decoder import TextConfig, UnsupportedCheckpoint
from .vit import ViTLayer, conv_as_matmul_weight, pixel_shuffle
from .weights import Tensors, layer_keys, text_decoder


@dataclass
class VisionConfig:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    image_size: int  # one tile's side in pixels
    patch_size: int
    eps: float
    act: str


@dataclass
class SmolVLMConfig:
    vision: VisionConfig
    text: TextConfig
    scale_factor: int
    image_token_id: int
    tie_word_embeddings: bool

    @property
    def patches_per_tile(self) -> int:
        return (self.vision.image_size // self.vision.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_tile // self.scale_factor**2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "SmolVLMConfig":
        v, t = cfg["vision_config"], cfg["text_config"]
        # transformers 5 ties lm_head to embed_tokens by the top-level flag (_tied_weights_keys);
        # released SmolVLM configs carry it at both levels.
        tie = cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        return cls(
            vision=VisionConfig(
                hidden=v["hidden_size"],
                heads=v["num_attention_heads"],
                layers=v["num_hidden_layers"],
                intermediate=v["intermediate_size"],
                image_size=v["image_size"],
                patch_size=v["patch_size"],
                eps=v.get("layer_norm_eps", 1e-6),
                act=v.get("hidden_act", "gelu_pytorch_tanh"),
            ),
            text=TextConfig.from_hf({"model_type": "llama", **t}),
            scale_factor=cfg.get("scale_factor", 2),
            image_token_id=cfg["image_token_id"],
            tie_word_embeddings=bool(tie),
        )


def patch_position_ids(num_patches_per_side: int) -> torch.Tensor:
    """Position ids of a full tile, computed as SmolVLMVisionEmbeddings.forward does (bucketize of
    fractional coordinates) so that float rounding matches the reference exactly."""
    n = num_patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n))), max=1.0 - 1e-6)
    bucket = torch.bucketize(coords, boundaries, right=True)
    return (bucket[:, None] * n + bucket[None, :]).reshape(-1)


class VisionEncoder(nn.Module, VisionModule):
    """One tile -> image-token embeddings in the decoder's space.

    forward(patches [patches, 3*p*p]) -> [tokens_per_tile, text_hidden]
    """

    def __init__(self, cfg: SmolVLMConfig):
        super().__init__()
        v = cfg.vision
        self.side = v.image_size // v.patch_size
        self.scale = cfg.scale_factor
        self.patch_embedding = nn.Linear(3 * v.patch_size**2, v.hidden)  # Conv2d as MatMul
        self.position_embedding = nn.Parameter(torch.zeros(self.side**2, v.hidden))  # already gathered for a full tile
        self.layers = nn.ModuleList(ViTLayer(v.hidden, v.heads, v.intermediate, v.eps, v.act) for _ in range(v.layers))
        self.post_layernorm = nn.LayerNorm(v.hidden, eps=v.eps)
        self.proj = nn.Linear(v.hidden * cfg.scale_factor**2, cfg.text.hidden, bias=False)

    def forward(self, patches):
        x = self.patch_embedding(patches) + self.position_embedding  # [patches, vision_hidden]
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        x = pixel_shuffle(x, self.side, self.scale)  # [tokens, vision_hidden*scale^2]
        return self.proj(x)  # [tokens, text_hidden]


# --- weights: HF name -> ours ---------------------------------------------------------------
# Checkpoints name the inner model "model." (transformers >= 4.46 / 5.x); older Idefics3 exports
# have no prefix. Keys below are relative to that inner model's vision_model. (SiglipEncoderLayer -> vit.ViTLayer)
VISION_LAYER_KEYS = {
    "layers.{i}.norm1.{p}": "encoder.layers.{i}.layer_norm1.{p}",
    "layers.{i}.norm2.{p}": "encoder.layers.{i}.layer_norm2.{p}",
    "layers.{i}.q_proj.{p}": "encoder.layers.{i}.self_attn.q_proj.{p}",
    "layers.{i}.k_proj.{p}": "encoder.layers.{i}.self_attn.k_proj.{p}",
    "layers.{i}.v_proj.{p}": "encoder.layers.{i}.self_attn.v_proj.{p}",
    "layers.{i}.out_proj.{p}": "encoder.layers.{i}.self_attn.out_proj.{p}",
    "layers.{i}.fc1.{p}": "encoder.layers.{i}.mlp.fc1.{p}",
    "layers.{i}.fc2.{p}": "encoder.layers.{i}.mlp.fc2.{p}",
}


def _inner_prefix(keys) -> str:
    for prefix in ("model.", ""):
        if f"{prefix}text_model.embed_tokens.weight" in keys:
            return prefix
    raise UnsupportedCheckpoint("not a SmolVLM/Idefics3 checkpoint: no text_model.embed_tokens.weight")


def load_weights(cfg: SmolVLMConfig, tensors: dict[str, torch.Tensor]) -> Weights:
    """Build the modules from HF tensors: (vision, decoder, embedding table [vocab, hidden])."""
    pre = _inner_prefix(tensors.keys())
    vp, tp = pre + "vision_model.", pre + "text_model."
    take = Tensors(tensors)
    vision = VisionEncoder(cfg)
    vsd = {
        "patch_embedding.weight": conv_as_matmul_weight(take(vp + "embeddings.patch_embedding.weight")),
        "patch_embedding.bias": take(vp + "embeddings.patch_embedding.bias"),
        "position_embedding": take(vp + "embeddings.position_embedding.weight")[patch_position_ids(vision.side)],
        "post_layernorm.weight": take(vp + "post_layernorm.weight"),
        "post_layernorm.bias": take(vp + "post_layernorm.bias"),
        "proj.weight": take(pre + "connector.modality_projection.proj.weight"),
    }
    vsd.update((ours, take(vp + theirs)) for ours, theirs in layer_keys(VISION_LAYER_KEYS, cfg.vision.layers))
    vision.load_state_dict(vsd, strict=True)
    dec, embed = text_decoder(cfg.text, take, tp, "lm_head.weight", cfg.tie_word_embeddings)
    take.check_all_used()
    return Weights(vision.eval(), dec, embed)


# --- what the runtime needs besides graphs: host preprocessing, prompt, special tokens --------
# transformers' SmolVLMProcessor (processing_smolvlm.py) writes a video's prompt with these strings, and renders a
# conversation holding a video with its own template (DEFAULT_CHAT_TEMPLATE), whatever the checkpoint's is
VIDEO_INTRO = "You are provided the following series of {frame_count} frames from a {video_duration} [H:MM:SS] video.\n"
VIDEO_FRAME_LINE = "\nFrame from {timestamp}:"
VIDEO_OUTRO = "\n\n"
VIDEO_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


# SmolVLMVideoProcessor's class defaults (transformers' video_processing_smolvlm.py), where its settings leave one out
VIDEO_SIZE = 4 * 364
VIDEO_FRAME_SIZE = 364
# SmolVLMProcessor's and Idefics3Processor's image_seq_len default (where processor_config.json gives none)
IMAGE_SEQ_LEN = 169


def video_spec(ckpt, tile: int) -> dict[str, Any] | None:
    """SmolVLMVideoProcessor's settings (Checkpoint.video_processor: processor_config.json's "video_processor", else
    video_preprocessor_config.json, else preprocessor_config.json, as transformers reads them) as the manifest's
    video spec: how many frames (video_sampling's fps / max_frames, which its __init__ takes over the fps /
    num_frames keys), their size (size over video_sampling's video_size), the frame tile (max_image_size). None where
    the settings say no sampling (SmolVLM 1, Idefics3: an image processor's settings), whose bundles refuse videos."""
    vp = ckpt.video_processor() or {}
    sampling = vp.get("video_sampling") or {}
    fps, frames = sampling.get("fps", vp.get("fps")), sampling.get("max_frames", vp.get("num_frames"))
    if fps is None or frames is None:
        return None
    size = (vp.get("size") or sampling.get("video_size") or {}).get("longest_edge", VIDEO_SIZE)
    frame = (vp.get("max_image_size") or {}).get("longest_edge", VIDEO_FRAME_SIZE)
    if frame != tile:
        raise UnsupportedCheckpoint(f"the video processor's max_image_size {frame} differs from the vision tile {tile}")
    return {"fps": float(fps), "max_frames": int(frames), "skip_secs": 1.0,
            "longest_edge": int(size), "frame_size": int(frame),
            "resample": resample_name(vp["resample"]) if "resample" in vp else "lanczos",
            "placeholder": "<video>", "chat_template": VIDEO_CHAT_TEMPLATE, "intro": VIDEO_INTRO,
            "frame_line": VIDEO_FRAME_LINE, "outro": VIDEO_OUTRO}


def host_spec(ckpt, cfg: SmolVLMConfig, tok_json: dict) -> HostSpec:
    """Image/prompt/special-token parameters from the checkpoint's processor settings, read as transformers reads
    them in either layout (families/checkpoint.py): SmolVLMImageProcessor's (required: transformers makes no
    SmolVLMProcessor without them), SmolVLMProcessor's own (image_seq_len, its class default where absent) and the
    tokenizer's named tokens (the processor's defaults where absent)."""
    processor = "SmolVLMProcessor" if ckpt.config.get("model_type") == "smolvlm" else "Idefics3Processor"
    pp = ckpt.require_image_processor(processor)
    proc = ckpt.processor_settings()
    tc = ckpt.named_tokens()
    tile = pp.get("max_image_size", {}).get("longest_edge", cfg.vision.image_size)
    if tile != cfg.vision.image_size:
        raise UnsupportedCheckpoint(f"max_image_size {tile} differs from the vision tower's image_size {cfg.vision.image_size}")
    seq = proc.get("image_seq_len", IMAGE_SEQ_LEN)
    if seq != cfg.tokens_per_tile:
        why = "" if "image_seq_len" in proc else f" ({processor}'s default: processor_config.json gives none)"
        raise UnsupportedCheckpoint(f"processor image_seq_len {seq}{why} != tokens per tile {cfg.tokens_per_tile} "
                                    "from the config")
    params = {"longest_edge": pp.get("size", {}).get("longest_edge", 4 * tile), "split": pp.get("do_image_splitting", True)}
    image = processor_image(pp, tiling="longest_edge_grid", tile_size=tile, patch_size=cfg.vision.patch_size,
                            params=params, resample=1, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])  # (lanczos)
    tokens = {
        "image_token": tc.get("image_token", "<image>"),
        "fake_token": tc.get("fake_image_token", "<fake_token_around_image>"),
        "global_token": tc.get("global_image_token", "<global-img>"),
        "tile_marker": "<row_{row}_col_{col}>",
    }
    return HostSpec(image=image, prompt_expansion="grid_markers", prompt_params=tokens,
                    image_placeholder=tokens["image_token"], image_token_id=cfg.image_token_id,
                    video=video_spec(ckpt, tile))


def default_max_context(cfg: SmolVLMConfig, host: HostSpec) -> tuple[int, str]:
    return 1024, "vlmrt's default for SmolVLM: a 4x4 grid + global tile of 64-token tiles and text"


FAMILY = Family(name="smolvlm", model_types=("smolvlm", "idefics3"), config_from_hf=SmolVLMConfig.from_hf,
                load_weights=load_weights, host_spec=host_spec, default_max_context=default_max_context)
