"""LFM2's decoder as one static step over `ar` rows, its state outside the graph: K/V rows for the attention layers,
conv rows for the conv layers (transformers/models/lfm2/modeling_lfm2.py is the reference).

A conv layer (Lfm2ShortConv): in_proj -> B, C, x (each [ar, hidden]); the conv's input is B * x; a causal depthwise
conv of kernel L over time; times C; out_proj. Its state is per slot, like K/V rows (the cache kind "conv"): slot p
holds the conv input row (B * x) of slot p. A step at slots s .. s+ar-1 takes the W = L - 1 rows of slots s-W .. s-1
(zeros before slot 0) as past_conv_i [W, hidden] and returns its own ar rows as new_conv_i [ar, hidden], which the host
writes at slots s.. exactly as it writes K/V rows — so block prefill, lookahead (only accepted rows are written) and
prefix reuse (the kept slots hold the prefix's rows) need no snapshot of a rolling state. Under gqa_in_place, whose
layers run on [1, ar, hidden], they are [1, W, hidden] and [1, ar, hidden]: [B, W, hidden] and [B, ar / B, hidden] in a
batch of B sequences (export/batch_dim.py; the conv is then a depthwise Conv, no size taken from ar).

An attention layer: GQA with RMSNorm over each head's q and k before RoPE (as Qwen3), the rows contract of
families/layers.py CachedGQAttention. Each layer: x + op(operator_norm(x)); x + SwiGLU(ffn_norm(x)). Then
embedding_norm (LFM2's final norm) and the lm head (tied to the embeddings in the released checkpoints).

    forward(inputs_embeds [ar, hidden], position_ids [1, ar], *step (the attention kind's), *state[, logit_rows [r]])
      state: per layer in order, attention: past_key_i, past_value_i (the kind's: rows [ctx, kv_dim] or
      GroupQueryAttention's buffers [1, kv_heads, max_context, head_dim]); conv: past_conv_i [W, hidden] ([1, W, hidden])
      -> (logits [ar or r, vocab], per layer in order: the attention kind's outputs | new_conv_i [ar, hidden]
          ([1, ar, hidden])[, next_token [r]: gqa_in_place])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import DecoderModule, layers
from ..layers import ATTENTION_KINDS, CachedGQAttention, GatedMLP, RMSNorm
from .config import Lfm2TextConfig


class ShortConv(nn.Module):
    """LFM2's gated short convolution with its window of past conv-input rows as I/O."""

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.kernel = kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(hidden, kernel))  # depthwise: HF conv.weight [hidden, 1, L]
        self.conv_bias = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x, past):
        """x, past in the attention kind's layout: [ar, hidden], [L-1, hidden] (the rows kinds) or [B, s, hidden],
        [B, L-1, hidden] (gqa_in_place: B sequences of s rows, export/batch_dim.py) -> (out like x, bx: the conv
        input rows like x, the state rows)."""
        if x.dim() == 3:
            return self._batched(x, past)
        hidden = x.shape[-1]
        ar = x.shape[0]
        b, c, xx = self.in_proj(x).split(hidden, dim=-1)  # [ar, hidden] each (HF's chunk(3) of BCx)
        bx = b * xx  # [ar, hidden]: the conv's input, the state rows
        seq = torch.cat([past, bx], dim=0)  # [L-1 + ar, hidden]
        out = seq[0:ar] * self.conv_weight[:, 0]
        for k in range(1, self.kernel):  # out[t] = sum_k w[k] * seq[t + k]: tap k reads slot t + k - (L-1)
            out = out + seq[k:k + ar] * self.conv_weight[:, k]
        if self.conv_bias is not None:
            out = out + self.conv_bias
        return self.out_proj(c * out), bx

    def _batched(self, x, past):
        """x [B, s, hidden], past [B, L-1, hidden]: the same conv as a depthwise Conv over time (HF's nn.Conv1d), with
        no size taken from s, so the graph is shape-agnostic: export/batch_dim.py's enter Reshape [B, ar / B, hidden]
        splits the rows into sequences and each sequence's conv reads its own window."""
        hidden = x.shape[-1]
        b, c, xx = self.in_proj(x).split(hidden, dim=-1)  # [B, s, hidden] each
        bx = b * xx  # [B, s, hidden]
        seq = torch.cat([past, bx], dim=1).transpose(1, 2)  # [B, hidden, L-1 + s]
        out = F.conv1d(seq, self.conv_weight[:, None, :], self.conv_bias, groups=hidden)  # [B, hidden, s]
        return self.out_proj(c * out.transpose(1, 2)), bx


class Lfm2Layer(nn.Module):
    """operator_norm / ffn_norm / feed_forward under the HF-Llama names the quantizer matches (input_layernorm,
    post_attention_layernorm, mlp); the operator is `conv` (ShortConv) or `self_attn` (CachedGQAttention)."""

    def __init__(self, kind: str, t: Lfm2TextConfig):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(t.hidden, t.eps)  # operator_norm
        if kind == "conv":
            self.conv = ShortConv(t.hidden, t.conv_kernel, t.conv_bias)
        else:
            self.self_attn = CachedGQAttention(t.hidden, t.heads, t.kv_heads, t.head_dim, qk_norm=True, eps=t.eps)
        self.post_attention_layernorm = RMSNorm(t.hidden, t.eps)  # ffn_norm
        self.mlp = GatedMLP(t.hidden, t.intermediate, "silu")  # w1 = gate_proj, w3 = up_proj, w2 = down_proj

    def forward(self, x, kind, rope, step, *state):
        y = self.input_layernorm(x)
        if self.kind == "conv":
            a, *new = self.conv(y, *state)
        else:
            a, *new = self.self_attn(y, kind, rope, step, *state)
        x = x + a
        return (x + self.mlp(self.post_attention_layernorm(x)), *new)


class Lfm2Decoder(nn.Module, DecoderModule):
    """The decoder graph's module (module doc), with layers.CausalDecoder's step contract: the attention layers
    step as the attention kind named (ATTENTION_KINDS) says, the conv layers take their window whatever the kind.
    logit_rows: the graph takes the rows whose logits it returns."""

    def __init__(self, t: Lfm2TextConfig, attention: str = "rows_copy_free", logit_rows: bool = False):
        super().__init__()
        self.text, self.logit_rows = t, logit_rows
        self.attention = ATTENTION_KINDS[attention]
        self.layers = nn.ModuleList(Lfm2Layer(kind, t) for kind in t.layer_types)
        self.norm = RMSNorm(t.hidden, t.eps)  # embedding_norm
        self.lm_head = nn.Linear(t.hidden, t.vocab, bias=False)
        inv_freq, self.rope_scale = t.rope.frequencies(t.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("rope_pick", None, persistent=False)  # one rope row (layers._gathered_rope)
        self.rope_table(4096)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's cache kind (manifest.CACHE_LAYER_KINDS): the decoder protocol (families/__init__.py)."""
        return tuple("conv" if k == "conv" else "attention" for k in self.text.layer_types)

    @property
    def conv_state(self) -> tuple[int, int]:
        """(width, channels) of a conv layer's window: the kernel - 1 rows of hidden values."""
        return self.text.conv_kernel - 1, self.text.hidden

    def with_options(self, *, attention: str, logit_rows: bool, rope_positions: int) -> "Lfm2Decoder":
        new = Lfm2Decoder(self.text, attention=attention, logit_rows=logit_rows)
        new.load_state_dict(self.state_dict())
        new.rope_table(rope_positions)
        return new.eval()

    rope_table = layers.CausalDecoder.rope_table

    def forward(self, inputs_embeds, position_ids, *rest):
        kind = self.attention
        n_step = len(kind.step_inputs)
        step, state = rest[:n_step], rest[n_step:]
        if self.logit_rows:
            *state, rows = state
        rope = kind.rotary(self, position_ids, inputs_embeds.dtype)
        x, new, at = kind.enter(inputs_embeds), [], 0
        for layer in self.layers:
            n = 1 if layer.kind == "conv" else 2
            x, *rows_out = layer(x, kind, rope, step, *state[at:at + n])
            new += rows_out
            at += n
        x = kind.leave(x)
        if self.logit_rows:
            x = x.index_select(0, rows)
        logits = self.lm_head(self.norm(x))
        return (logits, *new, logits.argmax(-1)) if kind.argmax else (logits, *new)


def load(t: Lfm2TextConfig, take, prefix: str, lm_head: str | None) -> tuple[Lfm2Decoder, torch.Tensor]:
    """The decoder from the checkpoint's tensors under prefix (`model.language_model.`); lm_head None = tied.
    Returns (decoder, embedding table [vocab, hidden])."""
    embed = take(prefix + "embed_tokens.weight")
    sd = {"norm.weight": take(prefix + "embedding_norm.weight"), "lm_head.weight": embed if lm_head is None else take(lm_head)}
    for i, kind in enumerate(t.layer_types):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        names = {"operator_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
                 "feed_forward.w2.weight": "mlp.down_proj.weight"}
        if kind == "conv":
            names.update({"conv.in_proj.weight": "conv.in_proj.weight", "conv.out_proj.weight": "conv.out_proj.weight"})
            sd[dst + "conv.conv_weight"] = take(src + "conv.conv.weight")[:, 0, :]
            if t.conv_bias:
                names.update({"conv.in_proj.bias": "conv.in_proj.bias", "conv.out_proj.bias": "conv.out_proj.bias",
                              "conv.conv.bias": "conv.conv_bias"})
        else:
            names.update({f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkv"})
            names.update({"self_attn.out_proj.weight": "self_attn.o_proj.weight",
                          "self_attn.q_layernorm.weight": "self_attn.q_norm.weight",
                          "self_attn.k_layernorm.weight": "self_attn.k_norm.weight"})
        for s, d in names.items():
            sd[dst + d] = take(src + s)
    dec = Lfm2Decoder(t)
    dec.load_state_dict(sd, strict=True)
    return dec.eval(), embed
