"""The text decoders of the VLM families: Llama (SmolLM2), Qwen2/Qwen2.5, Qwen3 — one static module.

Differences are config flags, read once from the HF text config:
  Llama   no biases, no q/k norm, head_dim = hidden / heads
  Qwen2   q/k/v biases (transformers/models/qwen2/modeling_qwen2.py)
  Qwen3   RMSNorm on q and k per head before RoPE, explicit head_dim (models/qwen3/modeling_qwen3.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import layers
from .rope import Rope, UnsupportedRope


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
    vocab: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: Rope = field(default_factory=Rope)  # base theta and scaling type (rope.py)
    o_bias: bool = False  # Llama / Qwen3 attention_bias: o_proj has a bias too (Qwen2's q/k/v biases leave it out)
    mlp_bias: bool = False  # Llama mlp_bias

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_width(self) -> int:
        """A token's row (the host's table, the vision graph's output, the decoder's inputs_embeds): hidden."""
        return self.hidden

    @classmethod
    def from_hf(cls, t: dict[str, Any]) -> "TextConfig":
        model_type = t.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3"):
            raise UnsupportedCheckpoint(f"text model type {model_type!r} is not supported (llama, qwen2, qwen3)")
        try:
            rope = Rope.from_hf(t)
        except UnsupportedRope as e:
            raise UnsupportedCheckpoint(str(e)) from None
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
            vocab=t["vocab_size"],
            qkv_bias=model_type == "qwen2" or bool(t.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=rope,
            o_bias=model_type != "qwen2" and bool(t.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(t.get("mlp_bias", False)),
        )


def build(tc: TextConfig) -> layers.CausalDecoder:
    return layers.CausalDecoder(
        layers=tc.layers, hidden=tc.hidden, heads=tc.heads, kv_heads=tc.kv_heads, head_dim=tc.head_dim,
        intermediate=tc.intermediate, eps=tc.eps, act=tc.act, vocab=tc.vocab,
        qkv_bias=tc.qkv_bias, qk_norm=tc.qk_norm, rope=tc.rope,
        o_bias=tc.o_bias, mlp_bias=tc.mlp_bias,
    )


def load(tc: TextConfig, tensors: dict[str, torch.Tensor], take: Callable[[str], torch.Tensor], prefix: str,
         lm_head: str | None) -> tuple[layers.CausalDecoder, torch.Tensor]:
    """Decoder from the HF tensors under prefix (the text model's: `model.text_model.`, ...); lm_head None = tied to
    the embeddings. Our module names are HF's (Llama, Qwen2 and Qwen3 decoder layers alike), so loading is the prefix
    taken off (`sanitize`); take(name) fetches one tensor and records it as used.

    Returns (decoder, embedding table [vocab, hidden])."""
    embed = take(prefix + "embed_tokens.weight")
    sd = {"norm.weight": take(prefix + "norm.weight"), "lm_head.weight": embed if lm_head is None else take(lm_head)}
    sd.update(sanitize({n: take(n) for n in tensors if n.startswith(prefix + "layers.") and not n.endswith("inv_freq")},
                       prefix))
    dec = build(tc)
    result = dec.load_state_dict(sd, strict=False)
    if result.missing_keys:
        raise UnsupportedCheckpoint(f"checkpoint is missing weight {prefix}{result.missing_keys[0]}")
    if result.unexpected_keys:
        raise UnsupportedCheckpoint(f"checkpoint has {len(result.unexpected_keys)} decoder weights the config does not "
                                    f"describe, e.g. {prefix}{result.unexpected_keys[0]}")
    return dec.eval(), embed


def sanitize(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF decoder-layer names -> ours: the same names without the text model's prefix."""
    return {name[len(prefix):]: w for name, w in weights.items()}
