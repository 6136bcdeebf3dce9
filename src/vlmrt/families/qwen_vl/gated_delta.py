"""Qwen3.5's decoder (transformers/models/qwen3_5/modeling_qwen3_5.py is the reference): Gated DeltaNet layers
(`linear_attention`) and gated full-attention layers (`full_attention`) in the order of `layer_types`.

A Gated DeltaNet layer (Qwen3_5GatedDeltaNet): in_proj_qkv -> a causal depthwise conv of kernel L over time with SiLU
(its taps as slices, no Conv node; its window of the last W = L - 1 input rows is state) -> q, k (key heads,
l2-normalized), v (value heads); a, b -> the decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b); the
gated delta rule from the carried state [value heads, key_dim, value_dim] over the step's rows (one ORT LinearAttention node: families/linear_attention.py);
a gated RMSNorm per value head (weight * norm(o) * silu(z)); out_proj. The state is the cache kind "recurrent"
(manifest.RecurrentLayer): past_conv_i [B, W, channels] and past_state_i [B, heads, key_dim, value_dim] in,
present_conv_i and present_state_i (the state after the step's last row) out (runtime/decode/recurrent_state.py keeps
them).

A full-attention layer (Qwen3_5Attention): q_proj gives each head's query and its output gate side by side
([heads, 2 head_dim]); q / k RMSNorm per head; RoPE on the first rotary_dim dims of a head only, its frequencies from
M-RoPE's three rows interleaved (as Qwen3-VL's); attention over the cache (GroupQueryAttention, which rotates: the head
dims are permuted at load so that its rotate-half pairs are the partial rotation's, GatedAttention's doc);
out * sigmoid(gate); o_proj. The norms scale by 1 + w (Qwen3_5RMSNorm: the
weights load as 1 + w) but the DeltaNet's gated norm (w).

Every attention kind is built: gqa_in_place, rows_copy_free (`--attention portable`, the float decoder the GPTQ
calibration runs) and rows_concat (the HTP target's float graphs). A static graph (fixed AR, its last prompt block
padded: DecoderModule.valid_rows) takes valid_rows [ar] last and runs the rule in plain ops with the padding masked
out of the state and the conv window (families/gated_delta_rule.py); the others, one LinearAttention node.

    forward(inputs_embeds [ar, hidden], position_ids [3, ar], *the attention kind's step inputs, *state per layer
            (attention: the kind's K/V; recurrent: past_conv_i, past_state_i: [1, W, C], [1, heads, dk, dv] under
            gqa_in_place, [W, C], [heads, dk, dv] under the rows kinds)[, logit_rows [r]][, valid_rows [ar]])
      -> (logits, *the state out per layer[, next_token [r]: gqa_in_place])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import DecoderModule, layers
from .. import linear_attention  # noqa: F401  (registers torch.ops.vlmrt.linear_attention)
from ..gated_delta_rule import gated_delta_block, window_at_last_row
from ..decoder import UnsupportedCheckpoint
from ..layers import ATTENTION_KINDS, GatedMLP, RMSNorm
from .config import DeltaTextConfig, QwenVLConfig


def _l2norm(x):
    """transformers' l2norm (eps inside the root), in float32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, t: DeltaTextConfig):
        super().__init__()
        self.kh, self.vh = t.linear_key_heads, t.linear_value_heads
        self.dk, self.dv = t.linear_key_dim, t.linear_value_dim
        self.width, self.channels = t.conv_kernel - 1, t.conv_channels
        key, value = self.kh * self.dk, self.vh * self.dv
        self.in_proj_qkv = nn.Linear(t.hidden, 2 * key + value, bias=False)
        self.in_proj_z = nn.Linear(t.hidden, value, bias=False)
        self.in_proj_b = nn.Linear(t.hidden, self.vh, bias=False)
        self.in_proj_a = nn.Linear(t.hidden, self.vh, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.channels, t.conv_kernel))  # HF conv1d.weight [C, 1, L]
        self.dt_bias = nn.Parameter(torch.zeros(self.vh))
        self.A_log = nn.Parameter(torch.zeros(self.vh))
        self.norm = RMSNorm(self.dv, t.eps)  # the gated norm: weight * norm(o), then * silu(z)
        self.out_proj = nn.Linear(value, t.hidden, bias=False)

    def forward(self, x, conv_past, state, valid=None):
        """x [B, s, hidden] (gqa_in_place's layout: B sequences of s rows), conv_past [B, W, C], state [B, heads, dk,
        dv] -> (out like x, the conv window after the step [B, W, C], the state after it). valid [s] (a static graph's,
        B = 1: 1 for the step's real rows, 0 for its padding): the rule in plain ops, the state and the window kept at
        the last real row (gated_delta_rule.py); None: every row real, one LinearAttention node."""
        key = self.kh * self.dk
        qkv = self.in_proj_qkv(x)  # [B, s, C]
        seq = torch.cat([conv_past, qkv], dim=1)  # [B, W + s, C]
        # the depthwise conv as its W + 1 taps, each a slice of seq times a weight column (static slice bounds, any
        # s and B): ORT's depthwise Conv took 12 ms a decode step at the 0.8B layer's 6144 channels, the taps ~0.1
        w = self.width
        conv = seq[:, :-w] * self.conv_weight[:, 0]
        for k in range(1, w + 1):  # out[t] = sum_k w[k] * seq[t + k]: tap k reads slot t + k - W
            conv = conv + (seq[:, k:k - w] if k < w else seq[:, w:]) * self.conv_weight[:, k]
        conv = F.silu(conv)  # [B, s, C]
        q, k, v = conv.split([key, key, self.vh * self.dv], dim=-1)
        q = _l2norm(q.reshape(1, -1, self.kh, self.dk).float()).reshape(1, -1, key).to(x.dtype)
        k = _l2norm(k.reshape(1, -1, self.kh, self.dk).float()).reshape(1, -1, key).to(x.dtype)
        beta = torch.sigmoid(self.in_proj_b(x))  # [B, s, heads]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [B, s, heads]
        if valid is None:
            out, new_state = torch.ops.vlmrt.linear_attention(q, k, v, state, g.to(x.dtype), beta, self.kh, self.vh)
            window = seq[:, -self.width:]
        else:
            out, new_state = gated_delta_block(q[0], k[0], v[0], state[0], g[0], beta[0], valid.float(), self.kh, self.vh)
            out, new_state = out[None].to(x.dtype), new_state[None].to(state.dtype)
            window = window_at_last_row(seq[0], valid, self.width)[None]
        z = self.in_proj_z(x).reshape(1, -1, self.vh, self.dv)
        o = self.norm(out.reshape(1, -1, self.vh, self.dv)) * F.silu(z.float()).to(x.dtype)
        return self.out_proj(o.reshape(1, -1, self.vh * self.dv)), window, new_state


class GatedAttention(nn.Module):
    """q_proj [heads * 2 head_dim] (each head's query, then its gate), k/v/o projections, q/k norms (1 + w). The
    query and key dims of a head come permuted (rotary_perm, folded into q_proj, k_proj and the norms at load): the
    partial rotation's pairs (i, i + rotary/2) sit at GroupQueryAttention's (i, i + head_dim/2) and the dims it does
    not rotate at the rest, where the table holds cos 1, sin 0; q.k is the same under one permutation of both."""

    def __init__(self, t: DeltaTextConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = t.heads, t.kv_heads, t.head_dim
        self.q_proj = nn.Linear(t.hidden, 2 * t.heads * t.head_dim, bias=False)
        self.k_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=False)
        self.v_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=False)
        self.o_proj = nn.Linear(t.heads * t.head_dim, t.hidden, bias=False)
        self.q_norm = RMSNorm(t.head_dim, t.eps)
        self.k_norm = RMSNorm(t.head_dim, t.eps)

    def forward(self, x, kind, rope, step, past_k, past_v):
        """gqa_in_place: x [1, ar, hidden] ([B, ar / B, hidden] batched), rope layers._gqa_rope's (position ids, cos,
        sin); the rows kinds: x [ar, hidden], rope (cos, sin) [ar, head_dim], the kind's body over the cache."""
        if x.dim() == 2:
            return self._rows(x, kind, rope, step, past_k, past_v)
        seqlens_k, total = step
        positions, cos, sin = rope
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qg = self.q_proj(x).reshape(1, -1, h, 2 * d)
        q = self.q_norm(qg[..., :d]).reshape(1, -1, h * d)
        gate = qg[..., d:].reshape(1, -1, h * d)
        k = self.k_norm(self.k_proj(x).reshape(1, -1, kvh, d)).reshape(1, -1, kvh * d)
        out, pk, pv = torch.ops.vlmrt.group_query_attention(q, k, self.v_proj(x), past_k, past_v, seqlens_k, total,
                                                            cos, sin, positions, h, kvh)
        return self.o_proj(out * torch.sigmoid(gate)), pk, pv


    def _rows(self, x, kind, rope, step, past_k, past_v):
        """The rows contract: the kind's body (layers.ATTENTION_KINDS) over q / k already normed, v, and no output
        projection (_Projected), then the gate and o_proj."""
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qg = self.q_proj(x).reshape(-1, h, 2 * d)
        q = self.q_norm(qg[..., :d]).reshape(-1, h * d)
        k = self.k_norm(self.k_proj(x).reshape(-1, kvh, d)).reshape(-1, kvh * d)
        out, k_new, v_new = kind.body(_Projected(h, kvh, d, q, k, self.v_proj(x)), x, rope, step, past_k, past_v)
        return self.o_proj(out * torch.sigmoid(qg[..., d:].reshape(-1, h * d))), k_new, v_new


class _Projected:
    """What the rows kinds' bodies read of an attention module, with q and k given (normed) and no output projection."""

    def __init__(self, heads, kv_heads, head_dim, q, k, v):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj, self.k_proj, self.v_proj = (lambda x: q), (lambda x: k), (lambda x: v)
        self.q_norm = self.k_norm = self.o_proj = nn.Identity()


def rotary_perm(head_dim: int, rotary: int) -> torch.Tensor:
    """The head dims' order GatedAttention takes (new index -> the checkpoint's): the rotary halves at 0.. and
    head_dim/2.., the unrotated dims after each."""
    half, r = head_dim // 2, rotary // 2
    rest = list(range(rotary, head_dim))
    return torch.tensor(list(range(r)) + rest[: half - r] + list(range(r, rotary)) + rest[half - r:])


class DeltaLayer(nn.Module):
    def __init__(self, kind: str, t: DeltaTextConfig):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(t.hidden, t.eps)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(t)
        else:
            self.self_attn = GatedAttention(t)
        self.post_attention_layernorm = RMSNorm(t.hidden, t.eps)
        self.mlp = GatedMLP(t.hidden, t.intermediate, "silu")

    def forward(self, x, kind, rope, step, a, b, valid=None):
        y = self.input_layernorm(x)
        if self.kind == "linear_attention" and x.dim() == 3:  # gqa_in_place's [B, s, hidden]
            out, *new = self.linear_attn(y, a, b)
        elif self.kind == "linear_attention":  # the rows kinds' [ar, hidden], the state without a batch dim
            out, *new = self.linear_attn(y[None], a[None], b[None], valid)
            out, new = out[0], [t[0] for t in new]
        else:
            out, *new = self.self_attn(y, kind, rope, step, a, b)
        x = x + out
        return (x + self.mlp(self.post_attention_layernorm(x)), *new)


class DeltaDecoder(nn.Module, DecoderModule):
    """The decoder graph's module (module doc)."""

    rope_rows = 3
    attention_kinds = ("gqa_in_place", "rows_copy_free", "rows_concat")

    def __init__(self, t: DeltaTextConfig, rope_rows: tuple[int, ...], attention: str = "rows_copy_free",
                 logit_rows: bool = False):
        super().__init__()
        self.text, self.logit_rows, self.rows_of_freq = t, logit_rows, rope_rows
        self.attention = ATTENTION_KINDS[attention]
        self.layers = nn.ModuleList(DeltaLayer(kind, t) for kind in t.layer_types)
        self.norm = RMSNorm(t.hidden, t.eps)
        self.lm_head = nn.Linear(t.hidden, t.vocab, bias=False)
        inv_freq, _ = t.rope.frequencies(t.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the rope row of each of head_dim / 2 table columns: M-RoPE's for the rotary frequencies, 0 for the rest
        # (cos 1, sin 0 in every row); [3, 1, head_dim] one-hot as layers._gathered_rope takes it
        half = t.head_dim // 2
        cols = list(rope_rows) + [0] * (half - len(rope_rows))
        r = torch.tensor(cols * 2)
        self.register_buffer("rope_pick", (r[None, None, :] == torch.arange(3)[:, None, None]).float(), persistent=False)
        self.rope_table(4096)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("recurrent" if k == "linear_attention" else "attention" for k in self.text.layer_types)

    @property
    def recurrent_state(self) -> tuple[int, int, int, int, int]:
        t = self.text
        return t.conv_kernel - 1, t.conv_channels, t.linear_value_heads, t.linear_key_dim, t.linear_value_dim

    def with_options(self, *, attention: str, logit_rows: bool, rope_positions: int) -> "DeltaDecoder":
        new = DeltaDecoder(self.text, self.rows_of_freq, attention, logit_rows=logit_rows)
        new.load_state_dict(self.state_dict())
        new.rope_table(rope_positions)
        return new.eval()

    def rope_table(self, positions: int) -> None:
        """cos/sin [positions, head_dim] in float32 (transformers' per-step values) in GroupQueryAttention's columns
        (GatedAttention's doc): the rotary frequencies, then cos 1 / sin 0 for the dims not rotated, both halves."""
        cos, sin = layers.rope_cos_sin(torch.arange(positions), self.inv_freq)  # [positions, rotary]
        r, half = self.text.rotary_dim // 2, self.text.head_dim // 2
        ones, zeros = torch.ones(positions, half - r), torch.zeros(positions, half - r)
        c, s = torch.cat([cos[:, :r], ones], 1), torch.cat([sin[:, :r], zeros], 1)
        self.register_buffer("rope_cos", torch.cat([c, c], 1), persistent=False)
        self.register_buffer("rope_sin", torch.cat([s, s], 1), persistent=False)

    def forward(self, inputs_embeds, position_ids, *rest):
        kind = self.attention
        n_step = len(kind.step_inputs)
        step, state = rest[:n_step], rest[n_step:]
        if self.logit_rows:
            *state, rows = state
        valid = None
        if self.valid_rows:
            *state, valid = state
        rope = kind.rotary(self, position_ids, inputs_embeds.dtype)  # (M-RoPE's rows gathered: layers._gqa_rope)
        x, new = kind.enter(inputs_embeds), []
        for i, layer in enumerate(self.layers):
            x, *out = layer(x, kind, rope, step, state[2 * i], state[2 * i + 1], valid)
            new += out
        x = kind.leave(x)
        if self.logit_rows:
            x = x.index_select(0, rows)
        logits = self.lm_head(self.norm(x))
        return (logits, *new, logits.argmax(-1)) if kind.argmax else (logits, *new)


def load(cfg: QwenVLConfig, tensors, take, prefix: str) -> tuple[DeltaDecoder, torch.Tensor]:
    """The decoder from the checkpoint's tensors under prefix (`model.language_model.`); the norms' 1 + w folded in.
    Returns (decoder, embedding table [vocab, hidden])."""
    t: DeltaTextConfig = cfg.text
    embed = take(prefix + "embed_tokens.weight")
    one_plus = lambda w: 1.0 + w.float()  # noqa: E731  (Qwen3_5RMSNorm: x * (1 + w), in float32)
    sd = {"norm.weight": one_plus(take(prefix + "norm.weight")),
          "lm_head.weight": embed if cfg.tie_word_embeddings else take("lm_head.weight")}
    for i, kind in enumerate(t.layer_types):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[f"{dst}{n}.weight"] = one_plus(take(f"{src}{n}.weight"))
        for p in ("gate", "up", "down"):
            sd[f"{dst}mlp.{p}_proj.weight"] = take(f"{src}mlp.{p}_proj.weight")
        if kind == "linear_attention":
            a = f"{src}linear_attn."
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                sd[f"{dst}linear_attn.{n}.weight"] = take(f"{a}{n}.weight")
            conv = take(f"{a}conv1d.weight")  # [C, 1, L]
            if tuple(conv.shape) != (t.conv_channels, 1, t.conv_kernel):
                raise UnsupportedCheckpoint(f"{a}conv1d.weight {list(conv.shape)} is not [{t.conv_channels}, 1, "
                                            f"{t.conv_kernel}] (the linear_* heads and linear_conv_kernel_dim)")
            sd[f"{dst}linear_attn.conv_weight"] = conv[:, 0, :]
            sd[f"{dst}linear_attn.dt_bias"] = take(f"{a}dt_bias")
            sd[f"{dst}linear_attn.A_log"] = take(f"{a}A_log")
            sd[f"{dst}linear_attn.norm.weight"] = take(f"{a}norm.weight")
        else:
            a = f"{src}self_attn."
            d, perm = t.head_dim, rotary_perm(t.head_dim, t.rotary_dim)
            q = take(f"{a}q_proj.weight").reshape(t.heads, 2, d, -1)  # each head's query rows, then its gate's
            q = torch.stack([q[:, 0, perm], q[:, 1]], 1)
            sd[f"{dst}self_attn.q_proj.weight"] = q.reshape(2 * t.heads * d, -1)
            k = take(f"{a}k_proj.weight")
            sd[f"{dst}self_attn.k_proj.weight"] = k.reshape(t.kv_heads, d, -1)[:, perm].reshape(k.shape)
            for p in "vo":
                sd[f"{dst}self_attn.{p}_proj.weight"] = take(f"{a}{p}_proj.weight")
            for n in ("q_norm", "k_norm"):
                sd[f"{dst}self_attn.{n}.weight"] = one_plus(take(f"{a}{n}.weight"))[perm]
    dec = DeltaDecoder(t, tuple(cfg.mrope.rows()))
    try:
        dec.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # a weight of another shape than the config says
        raise UnsupportedCheckpoint(f"the checkpoint's decoder weights do not fit its text_config: "
                                    f"{str(e).splitlines()[-1].strip()[:200]}") from None
    return dec.eval(), embed
