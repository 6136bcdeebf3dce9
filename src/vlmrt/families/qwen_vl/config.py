"""Qwen2.5-VL / Qwen3-VL configs from config.json (transformers 5.24's Qwen2_5_VLConfig / Qwen3VLConfig fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoder import TextConfig, UnsupportedCheckpoint
from ..rope import Rope

# The vision graph's default patch budget: 4096 patches (1024 image tokens) holds a 1024×768 photo at Qwen2.5-VL's
# native resolution (4012 patches at 14 px) and 3072 at Qwen3-VL's 16 px; a larger image is resized to fit.
DEFAULT_MAX_PATCHES = 4096

MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


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
        sections = tuple(rope.get("mrope_section") or ())
        if len(sections) != 3:
            raise UnsupportedCheckpoint(f"mrope_section {list(sections)} is not three sections (t, h, w)")
        head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        if 2 * sum(sections) != head_dim:
            raise UnsupportedCheckpoint(f"mrope_section {list(sections)} does not cover head_dim {head_dim}")
        # the decoder layers are Qwen2's (2.5) or Qwen3's (3): the text config as that model type, rope plain
        base = {**t, "model_type": "qwen2" if kind == "qwen2_5_vl" else "qwen3",
                "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta", t.get("rope_theta", 10000.0))}}
        base.pop("rope_scaling", None)
        text = TextConfig.from_hf(base)
        return cls(
            kind=kind,
            vision=VisionConfig.from_hf(kind, cfg["vision_config"]),
            text=text,
            mrope=MRope(sections, interleaved=kind == "qwen3_vl"),  # as transformers: by model, not by a flag
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            image_token_id=int(cfg.get("image_token_id", 151655)),
            vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
        )

    @property
    def rope(self) -> Rope:
        return self.text.rope
