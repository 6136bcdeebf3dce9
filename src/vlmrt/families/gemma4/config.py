"""Gemma 4's text config (transformers 5.24 Gemma4TextConfig), read once from config.json: a `gemma4` checkpoint's
`text_config`, or a `gemma4_text` one's top level.

What is read, and from where both ways configs are written (the hub's and transformers' own save_pretrained):
  layer_types          "sliding_attention" | "full_attention" per layer (absent: every 6th full, as transformers)
  head_dim, kv heads   sliding layers: head_dim / num_key_value_heads; full layers: `per_layer_config[i]` where
                       transformers saved it (what differs from the top level), else `global_head_dim` (default
                       512) and, with attention_k_eq_v,
                       `num_global_key_value_heads` (the hub's form, which transformers turns into per_layer_config)
  rope_parameters      per layer type: theta, "default" or "proportional" (partial_rotary_factor of each head's
                       frequencies rotate, the rest are zero: cos 1, sin 0)
  num_kv_shared_layers the last layers read the K/V of the last earlier non-shared layer of their type
  per-layer inputs     hidden_size_per_layer_input (0: none), vocab_size_per_layer_input
  use_bidirectional_attention  "vision": image tokens see their whole image on the sliding layers in prefill
Refused in one line: MoE experts (enable_moe_block), a layer type other than the two, a rope type other than the two,
bidirectional attention over all tokens (use_bidirectional_attention "all")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..decoder import UnsupportedCheckpoint
from ..rope import Rope

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True)
class LayerRope:
    theta: float
    partial: float  # the share of each head's frequencies that rotate (proportional; 1.0 for default)

    def frequencies(self, head_dim: int) -> torch.Tensor:
        """inv_freq [head_dim / 2] as transformers computes it (modeling_rope_utils: default, proportional)."""
        rotated = int(self.partial * head_dim // 2)
        inv = 1.0 / (self.theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat([inv, torch.zeros(head_dim // 2 - rotated)]) if head_dim // 2 > rotated else inv


@dataclass(frozen=True)
class LayerShape:
    type: str  # LAYER_TYPES
    heads: int
    kv_heads: int
    head_dim: int
    k_eq_v: bool  # no v_proj: the values are the raw key projection (attention_k_eq_v on full layers)
    shares: int  # -1, or the layer whose K/V this one reads (num_kv_shared_layers)


@dataclass
class Gemma4TextConfig:
    hidden: int
    heads: int
    kv_heads: int  # the sliding layers' (TEXT_FIELDS: the shape most layers have)
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    act: str
    window: int
    shapes: tuple[LayerShape, ...]
    ropes: dict[str, LayerRope]
    per_layer: int  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int
    double_wide_mlp: bool
    softcap: float  # final_logit_softcapping (0: none)
    pad_id: int
    tie_word_embeddings: bool
    # use_bidirectional_attention "vision": during prefill an image token also sees its image's later tokens on the
    # sliding layers (transformers' create_masks_for_vision_model; full layers stay causal): the decoder's span input
    bidirectional_vision: bool = False

    @property
    def layers(self) -> int:
        return len(self.shapes)

    @property
    def row_width(self) -> int:
        """A token's row (the host's table, the vision graph's output, the decoder's inputs_embeds): the embedding
        and its per-layer rows side by side."""
        return self.hidden + self.per_layer_width

    @property
    def rope(self) -> Rope:
        """What the exporter checks against the max context: Gemma 4's ropes (default / proportional) have no
        context limit."""
        return Rope()

    @property
    def per_layer_width(self) -> int:
        """The per-layer rows a token carries beside its embedding: layers × hidden_size_per_layer_input."""
        return self.layers * self.per_layer

    def mlp_width(self, i: int) -> int:
        return self.intermediate * (2 if self.double_wide_mlp and self.shapes[i].shares >= 0 else 1)

    @classmethod
    def from_hf(cls, t: dict[str, Any]) -> "Gemma4TextConfig":
        if t.get("enable_moe_block"):
            raise UnsupportedCheckpoint("Gemma 4 MoE experts (enable_moe_block: the larger Gemma 4 sizes) are not "
                                        "supported: vlmrt exports the dense E2B / E4B decoders")
        if t.get("use_bidirectional_attention") == "all":
            raise UnsupportedCheckpoint("use_bidirectional_attention 'all' (a bidirectional text decoder) is not "
                                        "supported: vlmrt exports causal decoders")
        n = int(t["num_hidden_layers"])
        types = t.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        unknown = sorted({x for x in types if x not in LAYER_TYPES})
        if unknown or len(types) != n:
            raise UnsupportedCheckpoint(f"Gemma 4 layer type {', '.join(unknown) or 'count'} is not supported "
                                        f"(vlmrt knows {', '.join(LAYER_TYPES)}; {len(types)} types for {n} layers)")
        types = list(types[:-1]) + ["full_attention"]  # (transformers forces the last layer to full attention)
        ropes = {}
        for kind in LAYER_TYPES:
            p = (t.get("rope_parameters") or {}).get(kind) or {}
            rt = p.get("rope_type", "default" if kind == "sliding_attention" else "proportional")
            if rt not in ROPE_TYPES:
                raise UnsupportedCheckpoint(f"Gemma 4 {kind} rope type {rt!r} is not supported ({', '.join(ROPE_TYPES)})")
            if float(p.get("factor", 1.0)) != 1.0:
                raise UnsupportedCheckpoint(f"Gemma 4 {kind} rope factor {p['factor']} is not supported (1.0)")
            theta = float(p.get("rope_theta", 10_000.0 if kind == "sliding_attention" else 1_000_000.0))
            partial = float(p.get("partial_rotary_factor", 1.0)) if rt == "proportional" else 1.0
            ropes[kind] = LayerRope(theta, partial)
        heads, kv, hd = int(t["num_attention_heads"]), int(t["num_key_value_heads"]), int(t["head_dim"])
        k_eq_v = bool(t.get("attention_k_eq_v", False))
        # transformers' own save writes per_layer_config (only what differs from the top level: {} where nothing
        # does); the hub's configs write global_head_dim instead
        saved = t.get("per_layer_config")
        per_layer_config = {int(k): v for k, v in (saved or {}).items()}
        glob = {"head_dim": int(t.get("global_head_dim", 512))}
        if k_eq_v and t.get("num_global_key_value_heads") is not None:
            glob["num_key_value_heads"] = int(t["num_global_key_value_heads"])
        shared = int(t.get("num_kv_shared_layers") or 0)
        first_shared = n - shared
        shapes = []
        for i, kind in enumerate(types):
            over = per_layer_config.get(i, {}) if saved is not None else (glob if kind == "full_attention" else {})
            source = -1
            if i >= first_shared:
                earlier = [j for j in range(first_shared) if types[j] == kind]
                if not earlier:
                    raise UnsupportedCheckpoint(f"Gemma 4 layer {i} ({kind}) shares K/V but no earlier layer of its "
                                                "type has any")
                source = earlier[-1]
            shapes.append(LayerShape(kind, heads, int(over.get("num_key_value_heads", kv)),
                                     int(over.get("head_dim", hd)), k_eq_v and kind == "full_attention", source))
        return cls(hidden=int(t["hidden_size"]), heads=heads, kv_heads=kv, head_dim=hd,
                   intermediate=int(t["intermediate_size"]), vocab=int(t["vocab_size"]),
                   eps=float(t.get("rms_norm_eps", 1e-6)), act=t.get("hidden_activation", "gelu_pytorch_tanh"),
                   window=int(t.get("sliding_window", 512)), shapes=tuple(shapes), ropes=ropes,
                   per_layer=int(t.get("hidden_size_per_layer_input") or 0),
                   per_layer_vocab=int(t.get("vocab_size_per_layer_input") or t["vocab_size"]),
                   double_wide_mlp=bool(t.get("use_double_wide_mlp", False)),
                   softcap=float(t.get("final_logit_softcapping") or 0.0), pad_id=int(t.get("pad_token_id") or 0),
                   tie_word_embeddings=bool(t.get("tie_word_embeddings", True)),
                   bidirectional_vision=t.get("use_bidirectional_attention") == "vision")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text config of a `gemma4` checkpoint (text_config) or a `gemma4_text` one (the top level)."""
    return config["text_config"] if config.get("model_type") == "gemma4" else config


@dataclass(frozen=True)
class VisionSizes:
    patch_size: int


@dataclass
class Gemma4Config:
    """A `gemma4` checkpoint's config (families.FamilyConfig): the text config, the vision config as transformers
    saved it (vision.py reads it), the marker tokens. The vision graph takes max_soft_tokens × kernel² patch rows and
    gives max_soft_tokens rows; host_spec fixes max_soft_tokens from the image processor (the accessors run config,
    host, then weights)."""

    text: Gemma4TextConfig
    vision_config: dict[str, Any]
    vision: VisionSizes
    kernel: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int
    audio: bool  # the checkpoint has an audio tower (its weights are left out; audio input is refused)
    max_soft_tokens: int = 280  # Gemma4ImageProcessor's default, until host_spec reads the processor's
    tie_word_embeddings: bool = True

    @property
    def patches_per_tile(self) -> int:
        return self.max_soft_tokens * self.kernel ** 2

    @property
    def tokens_per_tile(self) -> int:
        return self.max_soft_tokens

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Gemma4Config":
        t = config["text_config"]
        v = config.get("vision_config")
        if not v:
            raise UnsupportedCheckpoint("the Gemma 4 checkpoint has no vision_config (a text-only checkpoint: vlmrt "
                                        "exports VLMs)")
        text = Gemma4TextConfig.from_hf(t)
        return cls(text=text, vision_config=dict(v), vision=VisionSizes(int(v.get("patch_size", 16))),
                   kernel=int(v.get("pooling_kernel_size", 3)),
                   image_token_id=int(config.get("image_token_id", 258_880)),
                   boi_token_id=int(config.get("boi_token_id", 255_999)),
                   eoi_token_id=int(config.get("eoi_token_id", 258_882)),
                   video_token_id=int(config.get("video_token_id", 258_884)), audio=bool(config.get("audio_config")),
                   tie_word_embeddings=text.tie_word_embeddings)
