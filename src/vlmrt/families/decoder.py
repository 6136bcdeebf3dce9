"""The text decoders of the VLM families: Llama (SmolLM2), Qwen2/Qwen2.5, Qwen3 — one static module.

Differences are config flags, read once from the HF text config:
  Llama   no biases, no q/k norm, head_dim = hidden / heads
  Qwen2   q/k/v biases (transformers/models/qwen2/modeling_qwen2.py)
  Qwen3   RMSNorm on q and k per head before RoPE, explicit head_dim (models/qwen3/modeling_qwen3.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import layers


class UnsupportedCheckpoint(ValueError):
    pass


@dataclass
class TextConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    intermediate: int
    eps: float
    act: str
    rope_theta: float
    vocab: int
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, t: dict[str, Any]) -> "TextConfig":
        model_type = t.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3"):
            raise UnsupportedCheckpoint(f"text model type {model_type!r} is not supported (llama, qwen2, qwen3)")
        rope = t.get("rope_scaling") or t.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedCheckpoint(f"RoPE scaling {rope_type!r} is not supported yet")
        if t.get("use_sliding_window"):
            raise UnsupportedCheckpoint("sliding-window attention is not supported yet")
        hidden, heads = t["hidden_size"], t["num_attention_heads"]
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=t.get("num_key_value_heads") or heads,
            head_dim=t.get("head_dim") or hidden // heads,
            layers=t["num_hidden_layers"],
            intermediate=t["intermediate_size"],
            eps=t.get("rms_norm_eps", 1e-6),
            act=t.get("hidden_act", "silu"),
            rope_theta=float(t.get("rope_theta", rope.get("rope_theta", 10000.0))),
            vocab=t["vocab_size"],
            qkv_bias=model_type == "qwen2" or bool(t.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def build(tc: TextConfig) -> layers.CausalDecoder:
    return layers.CausalDecoder(
        layers=tc.layers, hidden=tc.hidden, heads=tc.heads, kv_heads=tc.kv_heads, head_dim=tc.head_dim,
        intermediate=tc.intermediate, eps=tc.eps, act=tc.act, rope_theta=tc.rope_theta, vocab=tc.vocab,
        qkv_bias=tc.qkv_bias, qk_norm=tc.qk_norm,
    )


# HF decoder-layer names (relative to the text model) -> ours; the same in Llama, Qwen2 and Qwen3
LAYER_KEYS = {
    "layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
}
BIAS_KEYS = {f"layers.{{i}}.self_attn.{p}_proj.bias": f"layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"}
QK_NORM_KEYS = {f"layers.{{i}}.self_attn.{p}_norm.weight": f"layers.{{i}}.self_attn.{p}_norm.weight" for p in "qk"}


def load(tc: TextConfig, take: Callable[[str], torch.Tensor], prefix: str, lm_head: str | None) -> tuple[layers.CausalDecoder, torch.Tensor]:
    """Decoder from HF tensors named prefix + LAYER_KEYS...; lm_head None = tied to the embeddings.

    Returns (decoder, embedding table [vocab, hidden])."""
    keys = dict(LAYER_KEYS)
    if tc.qkv_bias:
        keys.update(BIAS_KEYS)
    if tc.qk_norm:
        keys.update(QK_NORM_KEYS)
    embed = take(prefix + "embed_tokens.weight")
    sd = {"norm.weight": take(prefix + "norm.weight"), "lm_head.weight": embed if lm_head is None else take(lm_head)}
    for i in range(tc.layers):
        for src, dst in keys.items():
            sd[dst.format(i=i)] = take(prefix + src.format(i=i))
    dec = build(tc)
    dec.load_state_dict(sd, strict=True)
    return dec.eval(), embed
