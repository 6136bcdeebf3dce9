"""LFM2-VL's config (transformers 5.24 Lfm2VlConfig: a siglip2_vision_model vision config, an lfm2 text config and
the projector's fields), read once from config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoder import UnsupportedCheckpoint
from ..rope import Rope, UnsupportedRope

LAYER_KINDS = ("conv", "full_attention")


@dataclass
class VisionConfig:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    patch_size: int
    position_side: int  # the learned position table is position_side × position_side (num_patches = side²)
    eps: float
    act: str


@dataclass
class Lfm2TextConfig:
    """LFM2 (transformers/models/lfm2): layers of kind "conv" (a gated short convolution) or "full_attention" (GQA
    with RMSNorm on q and k per head), each followed by a SwiGLU MLP."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    intermediate: int  # the MLP width after LFM2's block_auto_adjust_ff_dim
    conv_kernel: int  # conv_L_cache: a conv layer keeps the last conv_kernel - 1 rows of its input as state
    conv_bias: bool
    eps: float
    vocab: int
    rope: Rope

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_width(self) -> int:
        return self.hidden

    @classmethod
    def from_hf(cls, t: dict[str, Any]) -> "Lfm2TextConfig":
        if t.get("model_type", "lfm2") != "lfm2":
            raise UnsupportedCheckpoint(f"LFM2-VL text model type {t.get('model_type')!r} is not supported (lfm2)")
        try:
            rope = Rope.from_hf(t)
        except UnsupportedRope as e:
            raise UnsupportedCheckpoint(str(e)) from None
        n = t["num_hidden_layers"]
        kinds = t.get("layer_types")
        if kinds is None:  # older configs: full_attn_idxs (default: every layer attention), as Lfm2Config does
            full = t.get("full_attn_idxs")
            full = range(n) if full is None else full
            kinds = ["full_attention" if i in full else "conv" for i in range(n)]
        if len(kinds) != n or any(k not in LAYER_KINDS for k in kinds):
            raise UnsupportedCheckpoint(f"layer_types must be {n} of {', '.join(LAYER_KINDS)}, not {kinds}")
        hidden, heads = t["hidden_size"], t["num_attention_heads"]
        inter = t.get("block_ff_dim", t["intermediate_size"])
        if t.get("block_auto_adjust_ff_dim", True):  # Lfm2MLP: 2/3, × multiplier, rounded up to block_multiple_of
            inter = int(2 * inter / 3)
            if t.get("block_ffn_dim_multiplier", 1.0) is not None:
                multiple = t.get("block_multiple_of", 256)
                inter = int(t.get("block_ffn_dim_multiplier", 1.0) * inter)
                inter = multiple * ((inter + multiple - 1) // multiple)
        return cls(hidden=hidden, heads=heads, kv_heads=t.get("num_key_value_heads") or heads,
                   head_dim=t.get("head_dim") or hidden // heads, layer_types=tuple(kinds), intermediate=inter,
                   conv_kernel=t.get("conv_L_cache", 3), conv_bias=bool(t.get("conv_bias", False)),
                   eps=t.get("norm_eps", 1e-5), vocab=t["vocab_size"], rope=rope)


@dataclass
class Lfm2VlConfig:
    vision: VisionConfig
    text: Lfm2TextConfig
    downsample_factor: int
    projector_hidden: int
    projector_bias: bool
    projector_layernorm: bool
    projector_act: str
    image_token_id: int
    tie_word_embeddings: bool
    max_patches: int = 1024  # the vision graph's patch rows per tile (preprocessor max_num_patches; set at export)

    @property
    def patches_per_tile(self) -> int:
        return self.max_patches

    @property
    def tokens_per_tile(self) -> int:
        """The most image tokens a tile gives (a full 512² tile: 256); a smaller tile or thumbnail gives fewer."""
        return self.max_patches // self.downsample_factor**2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Lfm2VlConfig":
        v, t = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
        if v.get("model_type", "siglip2_vision_model") != "siglip2_vision_model":
            raise UnsupportedCheckpoint(f"LFM2-VL vision model type {v.get('model_type')!r} is not supported "
                                        "(siglip2_vision_model)")
        side = int(round(v.get("num_patches", 256) ** 0.5))
        if side * side != v.get("num_patches", 256):
            raise UnsupportedCheckpoint(f"vision num_patches {v.get('num_patches')} is not a square")
        # transformers 5 ties lm_head to embed_tokens by the top-level flag (tie_embedding in older configs)
        tie = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", t.get("tie_word_embeddings", True)))
        return cls(
            vision=VisionConfig(hidden=v.get("hidden_size", 768), heads=v.get("num_attention_heads", 12),
                                layers=v.get("num_hidden_layers", 12), intermediate=v.get("intermediate_size", 3072),
                                patch_size=v.get("patch_size", 16), position_side=side,
                                eps=v.get("layer_norm_eps", 1e-6), act=v.get("hidden_act", "gelu_pytorch_tanh")),
            text=Lfm2TextConfig.from_hf({"model_type": "lfm2", **t}),
            downsample_factor=cfg.get("downsample_factor", 2),
            projector_hidden=cfg.get("projector_hidden_size", 2560),
            projector_bias=bool(cfg.get("projector_bias", True)),
            projector_layernorm=bool(cfg.get("projector_use_layernorm", True)),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            image_token_id=cfg.get("image_token_id", 396),
            tie_word_embeddings=bool(tie),
        )
