"""The Qwen2.5-VL / Qwen3-VL decoder: the Qwen2 / Qwen3 layers of families/decoder.py with M-RoPE (cos / sin from 3
position rows, runtime/mrope.py computes them on the host) and DeepStack (Qwen3-VL: vision features added to the
image tokens' hidden states after decoder layers 0 .. levels-1).

MRopeDecoder.forward(inputs_embeds [ar, hidden], positions [3, ar] int64, attention_mask [ar, ctx+ar],
                     deepstack [ar, levels*hidden] (Qwen3-VL only; zero rows for text tokens), *past [ctx, kv_dim])
  -> (logits [ar, vocab], new_k_0, new_v_0, ...)   — the rows contract (families/layers.py)
"""

from __future__ import annotations

import torch
from torch import nn

from .. import decoder, layers
from ..decoder import UnsupportedCheckpoint
from .config import MRope, QwenVLConfig


class MRopeTable(nn.Module):
    """cos / sin [ar, head_dim] of 3-row positions, gathered from one table per frequency row (no Sin / Cos in the
    graph, as CausalDecoder.rope_table): row r of the positions gives the angles of the frequencies M-RoPE assigns
    to r; a one-hot [3, 1, head_dim/2] picks them, exactly (one term of each sum is non-zero)."""

    def __init__(self, inv_freq: torch.Tensor, mrope: MRope, positions: int):
        super().__init__()
        freqs = torch.arange(positions)[:, None].float() * inv_freq[None, :]  # [P, head_dim/2], as transformers
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        rows = torch.tensor(mrope.rows())
        self.register_buffer("pick", (rows[None, None, :] == torch.arange(3)[:, None, None]).float(), persistent=False)

    def forward(self, positions):  # [3, ar] -> cos, sin [ar, head_dim]
        cos = (self.cos[positions] * self.pick).sum(0)  # [ar, head_dim/2]
        sin = (self.sin[positions] * self.pick).sum(0)
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


class MRopeDecoder(nn.Module):
    def __init__(self, inner: layers.CausalDecoder, mrope: MRope, levels: int, positions: int):
        super().__init__()
        self.inner, self.levels = inner, levels
        self.rope = MRopeTable(inner.inv_freq, mrope, positions)

    def forward(self, inputs_embeds, positions, attention_mask, *rest):
        if self.levels:
            deepstack, *past = rest
        else:
            past = rest
        cos, sin = self.rope(positions)
        cos, sin = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)
        hidden = inputs_embeds.shape[1]
        x, new = inputs_embeds, []
        kind = self.inner.attention  # a rows attention body (families/layers.py ATTENTION_KINDS): rope = (cos, sin)
        for i, layer in enumerate(self.inner.layers):
            x, k, v = layer(x, kind, (cos, sin), (attention_mask,), past[2 * i], past[2 * i + 1])
            if i < self.levels:  # DeepStack: the image rows get this level's vision features
                x = x + deepstack[:, i * hidden:(i + 1) * hidden]
            new += [k, v]
        return (self.inner.lm_head(self.inner.norm(x)), *new)


def text_prefix(tensors) -> str:
    """Where the decoder's weights are: `model.language_model.` (Qwen3-VL, transformers 5) or `model.` (Qwen2.5-VL's
    hub layout)."""
    if any(n.startswith("model.language_model.") for n in tensors):
        return "model.language_model."
    if any(n.startswith("model.layers.") for n in tensors):
        return "model."
    raise UnsupportedCheckpoint("checkpoint has no decoder weights (model.language_model.* or model.layers.*)")


def deepstack_levels(cfg: QwenVLConfig) -> int:
    return len(cfg.vision.deepstack_layers)


def load(cfg: QwenVLConfig, tensors, take, positions: int) -> tuple[MRopeDecoder, torch.Tensor]:
    """(the decoder with M-RoPE and DeepStack, embedding table [vocab, hidden]); positions: rows of the rope table
    (the largest position a prompt of max context can reach, + 1)."""
    head = None if cfg.tie_word_embeddings else "lm_head.weight"
    inner, embed = decoder.load(cfg.text, tensors, take, text_prefix(tensors), head)
    return MRopeDecoder(inner, cfg.mrope, deepstack_levels(cfg), positions).eval(), embed
