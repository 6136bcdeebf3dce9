"""InternVL3 / InternVL3.5: InternViT + pixel-shuffle MLP projector + Qwen2.5 / Qwen3 decoder.

Two checkpoint layouts map onto one set of modules:
  transformers (`model_type: internvl`, InternVLForConditionalGeneration, the `-hf` repos) —
      mirrors transformers/models/internvl/modeling_internvl.py
  original OpenGVLab (`model_type: internvl_chat`, InternVLChatModel) — mirrors
      OpenGVLab's modeling_intern_vit.py / modeling_internvl_chat.py (fused qkv, ls1/ls2, mlp1.*)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import Family, HostSpec, VisionModule, Weights, layers, processor_image
from .decoder import TextConfig, UnsupportedCheckpoint
from .vit import ViTLayer, ViTOptions, conv_as_matmul_weight, pixel_shuffle
from .weights import Tensors, layer_keys, text_decoder

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def _side(v) -> int:
    if isinstance(v, (list, tuple)):
        if v[0] != v[1]:
            raise UnsupportedCheckpoint(f"non-square vision size {v} is not supported")
        return int(v[0])
    return int(v)


@dataclass
class VisionConfig:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    image_size: int
    patch_size: int
    eps: float
    act: str
    norm: str  # "layer_norm" | "rms_norm"
    qkv_bias: bool
    qk_norm: bool
    final_norm: bool  # transformers: LayerNorm after the encoder unless use_mean_pooling


@dataclass
class InternVLConfig:
    layout: str  # "hf" | "original"
    vision: VisionConfig
    text: TextConfig
    downsample_ratio: float
    tie_word_embeddings: bool
    feature_layer: int  # -1 = last layer (after the final norm, if any)
    drop_cls: bool
    projector_act: str
    image_token_id: int | None  # hf: config.image_token_id; original: from the tokenizer
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True

    @property
    def scale(self) -> int:
        return int(round(1 / self.downsample_ratio))

    @property
    def patches_per_tile(self) -> int:
        return (self.vision.image_size // self.vision.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_tile // self.scale**2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "InternVLConfig":
        if cfg.get("model_type") == "internvl_chat":
            return cls._from_original(cfg)
        v, t = cfg["vision_config"], cfg["text_config"]
        return cls(
            layout="hf",
            vision=VisionConfig(
                hidden=v["hidden_size"], heads=v["num_attention_heads"], layers=v["num_hidden_layers"],
                intermediate=v["intermediate_size"], image_size=_side(v.get("image_size", 448)),
                patch_size=_side(v.get("patch_size", 14)), eps=v.get("layer_norm_eps", 1e-6), act=v.get("hidden_act", "gelu"),
                norm=v.get("norm_type", "layer_norm"), qkv_bias=v.get("attention_bias", False),
                qk_norm=v.get("use_qk_norm", False), final_norm=not v.get("use_mean_pooling", True),
            ),
            text=TextConfig.from_hf(t),
            downsample_ratio=cfg.get("downsample_ratio", 0.5),
            # transformers 5 ties by the top-level flag; InternVLConfig defaults it to True
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            feature_layer=cfg.get("vision_feature_layer", -1),
            drop_cls=cfg.get("vision_feature_select_strategy", "default") == "default",
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            image_token_id=cfg.get("image_token_id", 151667),
        )

    @classmethod
    def _from_original(cls, cfg: dict[str, Any]) -> "InternVLConfig":
        v, t = cfg["vision_config"], cfg["llm_config"]
        if cfg.get("ps_version", "v2") != "v2":
            raise UnsupportedCheckpoint(f"pixel shuffle {cfg.get('ps_version')!r} is not supported (only v2)")
        size = cfg.get("force_image_size") or v.get("image_size", 448)
        return cls(
            layout="original",
            vision=VisionConfig(
                hidden=v["hidden_size"], heads=v["num_attention_heads"], layers=v["num_hidden_layers"],
                intermediate=v["intermediate_size"], image_size=_side(size), patch_size=_side(v.get("patch_size", 14)),
                eps=v.get("layer_norm_eps", 1e-6), act=v.get("hidden_act", "gelu"), norm=v.get("norm_type", "rms_norm"),
                qkv_bias=v.get("qkv_bias", True), qk_norm=v.get("qk_normalization", False), final_norm=False,
            ),
            text=TextConfig.from_hf(t),
            downsample_ratio=cfg.get("downsample_ratio", 0.5),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            feature_layer=cfg.get("select_layer", -1),
            drop_cls=True,
            projector_act="gelu",
            image_token_id=None,
            min_tiles=cfg.get("min_dynamic_patch", 1),
            max_tiles=cfg.get("max_dynamic_patch", 12) if cfg.get("dynamic_image_size", True) else 1,
            thumbnail=cfg.get("use_thumbnail", True),
        )


class VisionEncoder(nn.Module, VisionModule):
    """One tile -> image-token embeddings in the decoder's space.

    forward(patches [patches, 3*p*p]) -> [tokens_per_tile, text_hidden]
    """

    def __init__(self, cfg: InternVLConfig):
        super().__init__()
        v = cfg.vision
        self.side = v.image_size // v.patch_size
        self.scale = cfg.scale
        self.drop_cls = cfg.drop_cls
        run = v.layers if cfg.feature_layer == -1 else (cfg.feature_layer if cfg.feature_layer >= 0 else v.layers + 1 + cfg.feature_layer)
        self.patch_embedding = nn.Linear(3 * v.patch_size**2, v.hidden)  # Conv2d as MatMul
        self.cls_token = nn.Parameter(torch.zeros(1, v.hidden))
        self.position_embedding = nn.Parameter(torch.zeros(self.side**2 + 1, v.hidden))  # for this tile size
        # InternVLVisionLayer: x + λ1·attn(norm1(x)); x + λ2·mlp(norm2(x))
        opts = ViTOptions(norm=v.norm, qkv_bias=v.qkv_bias, qk_norm=v.qk_norm, layer_scale=True)
        self.layers = nn.ModuleList(ViTLayer(v.hidden, v.heads, v.intermediate, v.eps, v.act, opts) for _ in range(run))
        final = v.final_norm and cfg.feature_layer == -1
        self.final_norm = nn.LayerNorm(v.hidden, eps=v.eps) if final else nn.Identity()
        wide = v.hidden * self.scale**2
        self.proj_norm = nn.LayerNorm(wide, eps=1e-5)
        self.proj_1 = nn.Linear(wide, cfg.text.hidden)
        self.proj_act = layers.activation(cfg.projector_act)
        self.proj_2 = nn.Linear(cfg.text.hidden, cfg.text.hidden)

    def forward(self, patches):
        x = torch.cat([self.cls_token, self.patch_embedding(patches)]) + self.position_embedding  # [1+patches, dim]
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        if self.drop_cls:
            x = x[1:]
        x = pixel_shuffle(x, self.side, self.scale)  # [tokens, dim*scale^2]; InternVL v2 == Idefics3's
        return self.proj_2(self.proj_act(self.proj_1(self.proj_norm(x))))  # [tokens, text_hidden]


def interpolate_positions(pos: torch.Tensor, side: int) -> torch.Tensor:
    """[1+n², dim] -> [1+side², dim], bicubic like InternVLVisionEmbeddings.interpolate_pos_encoding."""
    n = int(math.isqrt(pos.shape[0] - 1))
    if n == side:
        return pos
    grid = pos[1:].reshape(1, n, n, -1).permute(0, 3, 1, 2)
    grid = nn.functional.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return torch.cat([pos[:1], grid.permute(0, 2, 3, 1).reshape(side * side, -1)])


# --- weights: HF name -> ours ---------------------------------------------------------------
# per vision layer, ours: (transformers name, original OpenGVLab name); None = fused / absent there
# (InternVLVisionLayer / InternVisionEncoderLayer -> vit.ViTLayer)
VISION_NORM_KEYS = {
    "layers.{i}.norm1.{p}": ("encoder.layer.{i}.layernorm_before.{p}", "encoder.layers.{i}.norm1.{p}"),
    "layers.{i}.norm2.{p}": ("encoder.layer.{i}.layernorm_after.{p}", "encoder.layers.{i}.norm2.{p}"),
}
VISION_LAYER_KEYS = {
    "layers.{i}.out_proj.{p}": ("encoder.layer.{i}.attention.projection_layer.{p}", "encoder.layers.{i}.attn.proj.{p}"),
    "layers.{i}.fc1.{p}": ("encoder.layer.{i}.mlp.fc1.{p}", "encoder.layers.{i}.mlp.fc1.{p}"),
    "layers.{i}.fc2.{p}": ("encoder.layer.{i}.mlp.fc2.{p}", "encoder.layers.{i}.mlp.fc2.{p}"),
}
VISION_SCALE_KEYS = {
    "layers.{i}.scale1": ("encoder.layer.{i}.lambda_1", "encoder.layers.{i}.ls1"),
    "layers.{i}.scale2": ("encoder.layer.{i}.lambda_2", "encoder.layers.{i}.ls2"),
}
VISION_QKV_KEYS = {  # transformers only: the original fuses them (attn.qkv, rows q | k | v)
    "layers.{i}.q_proj.{p}": "encoder.layer.{i}.attention.q_proj.{p}",
    "layers.{i}.k_proj.{p}": "encoder.layer.{i}.attention.k_proj.{p}",
    "layers.{i}.v_proj.{p}": "encoder.layer.{i}.attention.v_proj.{p}",
}
QK_NORM_KEYS = {
    "layers.{i}.q_norm.weight": ("encoder.layer.{i}.attention.q_norm.weight", "encoder.layers.{i}.attn.q_norm.weight"),
    "layers.{i}.k_norm.weight": ("encoder.layer.{i}.attention.k_norm.weight", "encoder.layers.{i}.attn.k_norm.weight"),
}
PROJECTOR_KEYS = {  # ours: (transformers, original mlp1 = Sequential(LayerNorm, Linear, GELU, Linear))
    "proj_norm.{p}": ("multi_modal_projector.layer_norm.{p}", "mlp1.0.{p}"),
    "proj_1.{p}": ("multi_modal_projector.linear_1.{p}", "mlp1.1.{p}"),
    "proj_2.{p}": ("multi_modal_projector.linear_2.{p}", "mlp1.3.{p}"),
}
# layout -> (root, vision, text model, lm head). transformers 5 saves the llava-style names
# (`vision_tower.`, `language_model.model.`, as the -hf repos hold); in memory it uses `model.`-rooted
# ones, which other writers may save — both are accepted.
PREFIXES = {
    "hf": ("", "vision_tower.", "language_model.model.", "language_model.lm_head.weight"),
    "hf-inner": ("model.", "model.vision_tower.", "model.language_model.", "lm_head.weight"),
    "original": ("", "vision_model.", "language_model.model.", "language_model.lm_head.weight"),
}


def _prefixes(cfg: InternVLConfig, keys) -> tuple[str, str, str, str]:
    if cfg.layout == "original":
        return PREFIXES["original"]
    for name in ("hf", "hf-inner"):
        if PREFIXES[name][1] + "embeddings.cls_token" in keys:
            return PREFIXES[name]
    raise UnsupportedCheckpoint("not an InternVL checkpoint: no vision_tower.embeddings.cls_token")


def _column(table: dict[str, tuple[str, str]], col: int) -> dict[str, str]:
    return {ours: names[col] for ours, names in table.items()}


def load_weights(cfg: InternVLConfig, tensors: dict[str, torch.Tensor]) -> Weights:
    """Build the modules from HF or original tensors: (vision, decoder, embedding table [vocab, hidden])."""
    col = 0 if cfg.layout == "hf" else 1
    root, vp, tp, head = _prefixes(cfg, tensors.keys())
    take = Tensors(tensors)
    v = cfg.vision
    vision = VisionEncoder(cfg)
    if cfg.layout == "hf":
        emb = {"patch": "embeddings.patch_embeddings.projection.", "cls": "embeddings.cls_token",
               "pos": "embeddings.position_embeddings"}
    else:
        emb = {"patch": "embeddings.patch_embedding.", "cls": "embeddings.class_embedding",
               "pos": "embeddings.position_embedding"}
    vsd = {
        "patch_embedding.weight": conv_as_matmul_weight(take(vp + emb["patch"] + "weight")),
        "patch_embedding.bias": take(vp + emb["patch"] + "bias"),
        "cls_token": take(vp + emb["cls"]).reshape(1, v.hidden),
        "position_embedding": interpolate_positions(take(vp + emb["pos"]).reshape(-1, v.hidden), vision.side),
    }
    if isinstance(vision.final_norm, nn.LayerNorm):
        vsd["final_norm.weight"] = take(vp + "layernorm.weight")
        vsd["final_norm.bias"] = take(vp + "layernorm.bias")
    n = len(vision.layers)
    keys = [*layer_keys(_column(VISION_NORM_KEYS, col), n, ("weight", "bias") if v.norm == "layer_norm" else ("weight",)),
            *layer_keys(_column(VISION_LAYER_KEYS, col), n)]
    if v.qk_norm:
        keys += layer_keys(_column(QK_NORM_KEYS, col), n, ("",))
    qkv = ("weight", "bias") if v.qkv_bias else ("weight",)
    if cfg.layout == "hf":
        keys += layer_keys(VISION_QKV_KEYS, n, qkv)
    vsd.update((ours, take(vp + theirs)) for ours, theirs in keys)
    vsd.update((ours, take(vp + theirs).reshape(-1)) for ours, theirs in layer_keys(_column(VISION_SCALE_KEYS, col), n, ("",)))
    if cfg.layout == "original":  # fused [3*dim, ...], rows q | k | v (InternAttention reshapes to (3, heads, head_dim))
        for i in range(n):
            for p in qkv:
                for part, q in zip("qkv", take(vp + f"encoder.layers.{i}.attn.qkv.{p}").chunk(3, dim=0)):
                    vsd[f"layers.{i}.{part}_proj.{p}"] = q
    for ours, theirs in layer_keys(_column(PROJECTOR_KEYS, col), 1):
        vsd[ours] = take((root if col == 0 else "") + theirs)
    vision.load_state_dict(vsd, strict=True)
    dec, embed = text_decoder(cfg.text, take, tp, head, cfg.tie_word_embeddings)
    # the vision layers past the feature layer are not built (VisionEncoder): theirs are not mapped
    take.check_all_used(lambda k: cfg.feature_layer != -1 and k.startswith(vp + "encoder."))
    return Weights(vision.eval(), dec, embed)


# --- what the runtime needs besides graphs ------------------------------------------------------
def _token_id(tok_json: dict, token: str) -> int | None:
    for t in tok_json.get("added_tokens", []):
        if t["content"] == token:
            return t["id"]
    return tok_json.get("model", {}).get("vocab", {}).get(token)


IMAGE_SEQ_LENGTH = 256  # InternVLProcessor's default image_seq_length


def host_spec(ckpt, cfg: InternVLConfig, tok_json: dict) -> HostSpec:
    """Image/prompt parameters: transformers' GotOcr2 image processor (crop_to_patches) and
    InternVLProcessor (`<img>` + `<IMG_CONTEXT>`×tokens×tiles + `</img>` in place of the template's image), read as
    transformers reads them in either layout (families/checkpoint.py). An -hf checkpoint must have the image
    processor's settings (transformers makes no InternVLProcessor without them); its image_seq_length is the
    processor class's default where processor_config.json gives none. The original layout (internvl_chat) is
    preprocessed by its model card's code, from config.json and constants, never by a processor: its CLIP-style
    preprocessor_config.json is read where there (its mean, std, resample are the card's) and not required."""
    original = cfg.layout == "original"
    pp = (ckpt.image_processor() or {}) if original else ckpt.require_image_processor("InternVLProcessor")
    proc = {} if original else ckpt.processor_settings()
    tc = ckpt.named_tokens()
    size = pp.get("size", {})
    tile = size.get("height", cfg.vision.image_size) if isinstance(size, dict) else cfg.vision.image_size
    if tile != cfg.vision.image_size:
        raise UnsupportedCheckpoint(f"processor tile size {tile} differs from the vision tower's {cfg.vision.image_size}")
    seq = cfg.tokens_per_tile if original else proc.get("image_seq_length", IMAGE_SEQ_LENGTH)
    if seq != cfg.tokens_per_tile:
        why = "" if "image_seq_length" in proc else " (InternVLProcessor's default: processor_config.json gives none)"
        raise UnsupportedCheckpoint(f"processor image_seq_length {seq}{why} != tokens per tile {cfg.tokens_per_tile}")
    # no crop_to_patches read: InternVLProcessor passes crop_to_patches=True to the image processor on every call,
    # over the preprocessor config's value (the released -hf repos ship false, and transformers tiles them)
    max_tiles = pp.get("max_patches", cfg.max_tiles)
    tokens = {
        "start_token": tc.get("start_image_token", "<img>"),
        "end_token": tc.get("end_image_token", "</img>"),
        "image_token": tc.get("context_image_token", "<IMG_CONTEXT>"),
    }
    image_token_id = cfg.image_token_id if cfg.image_token_id is not None else _token_id(tok_json, tokens["image_token"])
    if image_token_id is None or _token_id(tok_json, tokens["image_token"]) not in (None, image_token_id):
        raise UnsupportedCheckpoint(f"the tokenizer's {tokens['image_token']} id does not match the config's image_token_id")
    params = {"min_tiles": pp.get("min_patches", cfg.min_tiles), "max_tiles": max_tiles, "thumbnail": cfg.thumbnail}
    image = processor_image(pp, tiling="closest_aspect_grid", tile_size=tile, patch_size=cfg.vision.patch_size,
                            params=params, resample=3, mean=IMAGENET_MEAN, std=IMAGENET_STD)  # (bicubic)
    return HostSpec(image=image, prompt_expansion="wrapped_run", prompt_params=tokens,
                    image_placeholder=tokens["image_token"], image_token_id=image_token_id,
                    # original repos' templates know only string content: OpenGVLab's model.chat() writes
                    # "<image>\n" + question and expands "<image>" (used when the template renders no image item)
                    image_in_text_fallback=("<image>", "<image>\n"))


def default_max_context(cfg: InternVLConfig, host: HostSpec) -> tuple[int, str]:
    """Room for the default max tiles (+ thumbnail) and 512 tokens of text, rounded up to 256."""
    p = host.image.params
    tiles = p["max_tiles"] + (1 if p["thumbnail"] and p["max_tiles"] > 1 else 0)
    need = tiles * cfg.tokens_per_tile + 512
    ctx = -(-need // 256) * 256
    return ctx, f"{tiles} tiles × {cfg.tokens_per_tile} image tokens + 512 for text"


FAMILY = Family(name="internvl", model_types=("internvl", "internvl_chat"), config_from_hf=InternVLConfig.from_hf,
                load_weights=load_weights, host_spec=host_spec, default_max_context=default_max_context)
