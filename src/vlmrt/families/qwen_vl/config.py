"""Qwen2.5-VL / Qwen3-VL / Qwen3.5 configs from config.json (transformers 5.24's Qwen2_5_VLConfig / Qwen3VLConfig /
Qwen3_5Config fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoder import TextConfig, UnsupportedCheckpoint
from ..rope import Rope, UnsupportedRope

# The vision graph's default patch budget: 4096 patches (1024 image tokens) holds a 1024×768 photo at Qwen2.5-VL's
# native resolution (4012 patches at 14 px) and 3072 at Qwen3-VL's 16 px; a larger image is resized to fit.
DEFAULT_MAX_PATCHES = 4096

MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower. Qwen2.5-VL: RMSNorm blocks with a gated MLP, window attention except on `fullatt_blocks`.
    Qwen3-VL: LayerNorm blocks with a plain MLP, a learned position table interpolated to the grid, DeepStack mergers
    after the `deepstack_layers`."""

    kind: str  # "qwen2_5_vl" | "qwen3_vl"
    hidden: int
    heads: int
    depth: int
    intermediate: int
    act: str
    patch: int
    temporal_patch: int
    merge: int
    out_hidden: int  # the decoder's hidden size: what the merger outputs per token
    theta: float  # the 2-D rotary embedding's base
    in_channels: int = 3
    window: int = 0  # Qwen2.5-VL: window side in pixels
    fullatt_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks with full attention (the others attend in windows)
    position_side: int = 0  # Qwen3-VL: the learned position table is position_side² rows
    deepstack_layers: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output a DeepStack merger takes

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_size(self) -> int:  # (the family contract's name)
        return self.patch

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    @property
    def merge_unit(self) -> int:
        return self.merge * self.merge

    @classmethod
    def from_hf(cls, kind: str, v: dict[str, Any]) -> "VisionConfig":
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedCheckpoint(f"vision rotary type {rope.get('rope_type')!r} is not supported (axial)")
        common = dict(
            kind=kind, hidden=v["hidden_size"], heads=v["num_heads"], depth=v["depth"],
            intermediate=v["intermediate_size"], act=v.get("hidden_act", "silu" if kind == "qwen2_5_vl" else "gelu_pytorch_tanh"),
            patch=int(v.get("patch_size", 14 if kind == "qwen2_5_vl" else 16)), temporal_patch=int(v.get("temporal_patch_size", 2)),
            merge=int(v.get("spatial_merge_size", 2)), out_hidden=v["out_hidden_size"],
            theta=float(rope.get("rope_theta", 10000.0)), in_channels=int(v.get("in_channels", 3)),
        )
        if kind == "qwen2_5_vl":
            return cls(**common, window=int(v.get("window_size", 112)),
                       fullatt_blocks=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))))
        side = int(round(v.get("num_position_embeddings", 2304) ** 0.5))
        if side * side != v.get("num_position_embeddings", 2304):
            raise UnsupportedCheckpoint(f"num_position_embeddings {v['num_position_embeddings']} is not a square")
        return cls(**common, position_side=side, deepstack_layers=tuple(v.get("deepstack_visual_indexes", (8, 16, 24))))


@dataclass
class DeltaTextConfig(TextConfig):
    """Qwen3.5's text decoder (transformers' Qwen3_5TextConfig): `layer_types` of Gated DeltaNet layers
    (linear_attention: linear_* heads, a causal conv of linear_conv_kernel_dim) and gated full-attention layers (q/k
    norm, an output gate beside each query head, RoPE on the first `rotary_dim` dims of a head)."""

    layer_types: tuple[str, ...] = ()
    conv_kernel: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    rotary_dim: int = 0

    LAYER_TYPES = ("linear_attention", "full_attention")

    @property
    def conv_channels(self) -> int:
        """The conv's channels: q, k (key heads) and v (value heads) side by side."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @classmethod
    def from_qwen3_5(cls, t: dict[str, Any], rope: dict[str, Any]) -> "DeltaTextConfig":
        """From text_config; each field vlmrt cannot export refused in one line naming it (UnsupportedCheckpoint)."""

        def field(name: str, default=None) -> int:
            value = t.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedCheckpoint(f"text_config.{name} {value!r} is not a positive int")
            return value

        hidden, heads = field("hidden_size"), field("num_attention_heads")
        kv_heads, head_dim = field("num_key_value_heads", heads), field("head_dim", 256)
        layers = field("num_hidden_layers")
        types = t.get("layer_types")
        if types is None:  # transformers' default: every full_attention_interval-th layer full attention
            every = field("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise UnsupportedCheckpoint(f"text_config.layer_types names {len(types) if isinstance(types, list) else types!r} "
                                        f"layers, num_hidden_layers {layers}")
        for i, kind in enumerate(types):
            if kind not in cls.LAYER_TYPES:
                raise UnsupportedCheckpoint(f"text_config.layer_types[{i}] {str(kind)[:40]!r} is not a layer type vlmrt "
                                            f"exports ({', '.join(cls.LAYER_TYPES)})")
        if heads % kv_heads:
            raise UnsupportedCheckpoint(f"text_config.num_attention_heads {heads} is not a multiple of "
                                        f"num_key_value_heads {kv_heads}")
        key_heads, value_heads = field("linear_num_key_heads", 16), field("linear_num_value_heads", 32)
        if value_heads % key_heads:
            raise UnsupportedCheckpoint(f"text_config.linear_num_value_heads {value_heads} is not a multiple of "
                                        f"linear_num_key_heads {key_heads}")
        if t.get("attention_bias"):
            raise UnsupportedCheckpoint("text_config.attention_bias true is not supported (Qwen3.5 has none)")
        if t.get("hidden_act", "silu") != "silu":
            raise UnsupportedCheckpoint(f"text_config.hidden_act {t.get('hidden_act')!r} is not supported (silu)")
        factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise UnsupportedCheckpoint(f"text_config.rope_parameters.partial_rotary_factor {factor!r} is not in (0, 1]")
        rotary = int(head_dim * factor)
        if rotary < 2 or rotary % 2:
            raise UnsupportedCheckpoint(f"text_config.rope_parameters.partial_rotary_factor {factor} gives a rotary "
                                        f"width of {rotary} dims of head_dim {head_dim}: not a positive even number")
        try:
            base = Rope.from_hf({"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": rope.get("rope_theta", 10000000.0)},
                                 "max_position_embeddings": t.get("max_position_embeddings", 32768)})
        except UnsupportedRope as e:
            raise UnsupportedCheckpoint(f"text_config.rope_parameters: {e}") from None
        return cls(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=layers,
                   intermediate=field("intermediate_size"), eps=float(t.get("rms_norm_eps", 1e-6)), act="silu",
                   vocab=field("vocab_size"), qk_norm=True, rope=base, layer_types=tuple(types),
                   conv_kernel=field("linear_conv_kernel_dim", 4), linear_key_heads=key_heads,
                   linear_value_heads=value_heads, linear_key_dim=field("linear_key_head_dim", 128),
                   linear_value_dim=field("linear_value_head_dim", 128), rotary_dim=rotary)


@dataclass(frozen=True)
class MRope:
    """M-RoPE: each rotary frequency takes its angle from one of 3 position rows (temporal, height, width).
    `sections` = frequencies per row; Qwen2.5-VL takes them in runs ([t]*s0 + [h]*s1 + [w]*s2), Qwen3-VL
    interleaved (h at 1, 4, 7, ..., w at 2, 5, 8, ... up to 3*s1 / 3*s2, t elsewhere)."""

    sections: tuple[int, int, int]
    interleaved: bool

    def rows(self) -> list[int]:
        """The position row (0 t, 1 h, 2 w) of each of the head_dim / 2 frequencies."""
        n = sum(self.sections)
        if not self.interleaved:
            return [r for r, s in enumerate(self.sections) for _ in range(s)]
        out = [0] * n
        for r in (1, 2):
            for i in range(r, min(3 * self.sections[r], n), 3):  # a slice, as transformers': clipped at n
                out[i] = r
        return out


@dataclass(frozen=True)
class QwenVLConfig:
    kind: str  # config.json model_type
    vision: VisionConfig
    text: TextConfig
    mrope: MRope
    tie_word_embeddings: bool
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # the vision graph's patch budget (rows); 0 until the export chooses it (processing.image_spec: the --max-patches
    # option, else the default or the processor's own maximum)
    max_patches: int = 0

    @property
    def patches_per_tile(self) -> int:
        """The vision graph's input rows: the patch budget (an image is one tile at native resolution)."""
        return self.max_patches or DEFAULT_MAX_PATCHES

    @property
    def tokens_per_tile(self) -> int:
        """Its output rows: the most image tokens one image gives."""
        return self.patches_per_tile // self.vision.merge_unit

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "QwenVLConfig":
        kind = cfg.get("model_type")
        if kind not in MODEL_TYPES:
            raise UnsupportedCheckpoint(f"model type {kind!r} is not Qwen2.5-VL or Qwen3-VL")
        t = dict(cfg["text_config"])
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise UnsupportedCheckpoint(f"text rope type {rope.get('rope_type')!r} is not supported with M-RoPE "
                                        f"(default)")
        sections = tuple(rope.get("mrope_section") or ((11, 11, 10) if kind == "qwen3_5" else ()))
        if len(sections) != 3:
            raise UnsupportedCheckpoint(f"mrope_section {list(sections)} is not three sections (t, h, w)")
        if kind == "qwen3_5":
            # Qwen3.5: its own decoder (gated_delta.py); M-RoPE interleaved over the rotary dims only
            text = DeltaTextConfig.from_qwen3_5(t, rope)
            if 2 * sum(sections) != text.rotary_dim:
                raise UnsupportedCheckpoint(f"text_config.rope_parameters.mrope_section {list(sections)} does not "
                                            f"cover the rotary width {text.rotary_dim} (head_dim x partial_rotary_factor)")
            if rope.get("mrope_interleaved", True) is not True:
                raise UnsupportedCheckpoint("text_config.rope_parameters.mrope_interleaved false is not supported "
                                            "(Qwen3.5's M-RoPE is interleaved)")
        else:
            head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
            if 2 * sum(sections) != head_dim:
                raise UnsupportedCheckpoint(f"mrope_section {list(sections)} does not cover head_dim {head_dim}")
            # the decoder layers are Qwen2's (2.5) or Qwen3's (3): the text config as that model type, rope plain
            base = {**t, "model_type": "qwen2" if kind == "qwen2_5_vl" else "qwen3",
                    "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta", t.get("rope_theta", 10000.0))}}
            base.pop("rope_scaling", None)
            text = TextConfig.from_hf(base)
        # Qwen3.5's tower is Qwen3-VL's without DeepStack
        vision = (VisionConfig.from_hf("qwen3_vl", {**cfg["vision_config"], "deepstack_visual_indexes": []})
                  if kind == "qwen3_5" else VisionConfig.from_hf(kind, cfg["vision_config"]))
        ids = (248056, 248053, 248054) if kind == "qwen3_5" else (151655, 151652, 151653)  # the configs' defaults
        return cls(
            kind=kind,
            vision=vision,
            text=text,
            mrope=MRope(sections, interleaved=kind != "qwen2_5_vl"),  # as transformers: by model, not by a flag
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            image_token_id=int(cfg.get("image_token_id", ids[0])),
            vision_start_token_id=int(cfg.get("vision_start_token_id", ids[1])),
            vision_end_token_id=int(cfg.get("vision_end_token_id", ids[2])),
        )

    @property
    def rope(self) -> Rope:
        return self.text.rope
