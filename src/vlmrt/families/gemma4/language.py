"""Gemma 4's text decoder as one gqa_in_place step (transformers/models/gemma4/modeling_gemma4.py Gemma4TextModel is
the reference), its state outside the graph:

  sliding_attention layers  a windowed cache (cache kind "windowed_attention": window_capacity rows per buffer,
                            GroupQueryAttention's sliding_window_cache evicting in the graph; export/graphs.py
                            window_capacity) or, with a span input and under the rows kinds, K/V rows by slot (cache
                            kind "sliding_attention"); the node sees the last `window` keys (local_window_size =
                            window), RoPE of the sliding theta
  full_attention layers     K/V buffers of their own head_dim / kv heads (cache kind "attention"), proportional RoPE
                            (partial_rotary_factor of each head's frequencies rotate; the rest have frequency 0);
                            attention_k_eq_v: the values are the raw key projection
  kv-shared layers          (num_kv_shared_layers) no K/V projections, no state (cache kind "shared_kv"): their
                            GroupQueryAttention reads the source layer's buffers and is fed the source's step rows
                            again (it writes the same rows at the same slots into an output nobody reads)
Every attention: q/k RMSNorm per head (weights w, not 1 + w), v RMSNorm without a weight, scale 1. Each layer:
x + post_attention_norm(attn(input_norm(x))); x + post_ff_norm(mlp(pre_ff_norm(x))); the per-layer input block
x + post_norm(proj(act(gate(x)) * per_layer_input_i)); then x * layer_scalar. Then the final norm, the tied lm head
and the final logit soft-capping (tanh(logits / cap) * cap).

Per-layer inputs: the host's token row is [hidden + layers × per_layer] wide: the token embedding (times
sqrt(hidden)) and the token's per-layer row (embed_tokens_per_layer times sqrt(per_layer)) side by side, one table
row read per token (the bundle's embed.npy, read per row in its stored form: runtime/table_rows.py), so prompts,
decode steps, lookahead drafts and batched rows carry them without a part of their own; at an image token the
per-layer part is the pad token's (as transformers replaces image ids by the pad id there). The graph projects the embedding part
(per_layer_model_projection × hidden^-0.5, RMSNorm per layer) and adds the token part: (proj + rows) × 2^-0.5.

    forward(inputs_embeds [ar, hidden + L·P], position_ids [1, ar], [span_ids [ar] int64: bidirectional vision
            attention's image spans, -1 elsewhere], seqlens_k [1], total_sequence_length [],
            *state (per layer by kind: attention / windowed_attention / sliding_attention past_key_i, past_value_i;
            shared_kv none),
            logit_rows [r]) -> (logits [r, vocab], *the buffers updated, next_token [r])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import DecoderModule
from ..layers import ATTENTION_KINDS, apply_rope
from ..token_table import TokenTable
from .config import Gemma4TextConfig

ATTENTION = "gqa_in_place"  # the CPU's kind (sliding windows: the op's local_window_size); the rows kinds build the
# window into the sliding layers' mask (Gemma4Decoder._windowed)


class Gemma4RMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm: x · (mean(x²) + eps)^-0.5, times w (not 1 + w); with_scale False: no weight,
    written as a product with ones (exact) so that the HTP target fuses it as it fuses the others (fuse.py: a padded
    row's (0 + eps)^-0.5 = 1e3 would otherwise set that tensor's 16-bit range)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        if not with_scale:
            self.register_buffer("ones", torch.ones(dim), persistent=False)

    def forward(self, x):
        y = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (y * (self.ones if self.weight is None else self.weight.float())).to(x.dtype)


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")


class Gemma4Attention(nn.Module):
    def __init__(self, t: Gemma4TextConfig, i: int):
        super().__init__()
        s = t.shapes[i]
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.window = t.window if s.type == "sliding_attention" else 0
        self.shares = s.shares
        self.q_proj = nn.Linear(t.hidden, s.heads * s.head_dim, bias=False)
        self.q_norm = Gemma4RMSNorm(s.head_dim, t.eps)
        self.o_proj = nn.Linear(s.heads * s.head_dim, t.hidden, bias=False)
        if s.shares < 0:
            self.k_proj = nn.Linear(t.hidden, s.kv_heads * s.head_dim, bias=False)
            self.v_proj = None if s.k_eq_v else nn.Linear(t.hidden, s.kv_heads * s.head_dim, bias=False)
            self.k_norm = Gemma4RMSNorm(s.head_dim, t.eps)
            self.v_norm = Gemma4RMSNorm(s.head_dim, t.eps, with_scale=False)

    def forward(self, x, rope, step, kv, spans=None, capacity: int = 0):
        """gqa_in_place: x [1, ar, hidden]; rope (position_ids, cos, sin) of the layer's type; step (seqlens_k,
        total); kv: this layer's (past_k, past_v) buffers, or for a shared layer the source's (past_k, past_v, k rows,
        v rows) -> (out, present_k, present_v, k rows, v rows); spans [ar] (None: causal): the step's image spans,
        whose tokens see each other both ways (a sliding layer's, with bidirectional vision attention); capacity: the
        rows of a windowed cache's buffers (a sliding layer's; 0: by slot). The rows kinds: rows (below), the spans
        already in their mask."""
        if len(step) == 1:
            return self.rows(x, rope, step[0], kv)
        seqlens_k, total = step
        positions, cos, sin = rope
        ar, h, kvh, d = x.shape[1], self.heads, self.kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(1, ar, h, d)).reshape(1, ar, h * d)
        if self.shares >= 0:
            past_k, past_v, k, v = kv
        else:
            past_k, past_v = kv
            raw = self.k_proj(x).view(1, ar, kvh, d)
            v_raw = raw if self.v_proj is None else self.v_proj(x).view(1, ar, kvh, d)
            k = self.k_norm(raw).reshape(1, ar, kvh * d)
            v = self.v_norm(v_raw).reshape(1, ar, kvh * d)
        out, pk, pv = torch.ops.vlmrt.group_query_attention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin,
                                                            positions, h, kvh, self.window, 1.0, spans,
                                                            capacity if self.window else 0)
        return self.o_proj(out), pk, pv, k, v

    def rows(self, x, rope, mask, kv):
        """The rows contract (rows_copy_free / rows_concat): x [ar, hidden]; rope (cos, sin) [ar, d]; mask [ar,
        ctx + ar] (the kind's, from slots; a sliding layer's window already in it: Gemma4Decoder.forward); kv: this
        layer's past rows (past_k, past_v) [ctx, kv_dim], or for a shared layer the source's (past_k, past_v, k rows
        (rotated), v rows) -> (out, new k rows [ar, kv_dim], new v rows, k rows, v rows)."""
        cos, sin = rope
        ar, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(ar, h, d)), cos, sin)
        if self.shares >= 0:
            past_k, past_v, k, v = kv
        else:
            past_k, past_v = kv
            raw = self.k_proj(x).view(ar, kvh, d)
            v_raw = raw if self.v_proj is None else self.v_proj(x).view(ar, kvh, d)
            k = apply_rope(self.k_norm(raw), cos, sin)
            v = self.v_norm(v_raw)
        ctx = past_k.shape[0]
        keys = torch.cat([past_k.view(ctx, kvh, d), k], dim=0).permute(1, 2, 0)[:, None]  # [kvh, 1, d, ctx + ar]
        values = torch.cat([past_v.view(ctx, kvh, d), v], dim=0).transpose(0, 1)[:, None]  # [kvh, 1, ctx + ar, d]
        qg = q.view(ar, kvh, h // kvh, d).permute(1, 2, 0, 3)  # [kvh, rep, ar, d]: head j uses kv head j // rep
        probs = torch.softmax((torch.matmul(qg, keys) + mask).float(), dim=-1).to(x.dtype)  # scale 1
        out = torch.matmul(probs, values).permute(2, 0, 1, 3).reshape(ar, h * d)
        return self.o_proj(out), k.reshape(ar, kvh * d), v.reshape(ar, kvh * d), k, v


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, width: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.act = _act(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4Layer(nn.Module):
    def __init__(self, t: Gemma4TextConfig, i: int):
        super().__init__()
        self.type = t.shapes[i].type
        self.self_attn = Gemma4Attention(t, i)
        self.mlp = Gemma4MLP(t.hidden, t.mlp_width(i), t.act)
        self.input_layernorm = Gemma4RMSNorm(t.hidden, t.eps)
        self.post_attention_layernorm = Gemma4RMSNorm(t.hidden, t.eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(t.hidden, t.eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(t.hidden, t.eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.per_layer = t.per_layer
        if t.per_layer:
            self.act = _act(t.act)
            self.per_layer_input_gate = nn.Linear(t.hidden, t.per_layer, bias=False)
            self.per_layer_projection = nn.Linear(t.per_layer, t.hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(t.hidden, t.eps)

    def forward(self, x, per_layer_input, rope, step, kv, spans=None, capacity: int = 0):
        a, pk, pv, k, v = self.self_attn(self.input_layernorm(x), rope, step, kv, spans, capacity)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.per_layer:
            y = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(y))
        return x * self.layer_scalar, pk, pv, k, v


class Gemma4Decoder(nn.Module, DecoderModule):
    """The decoder graph's module (module doc): DecoderModule's step contract as gqa_in_place's."""

    def __init__(self, t: Gemma4TextConfig, logit_rows: bool = False, attention: str = ATTENTION):
        super().__init__()
        self.text, self.logit_rows = t, logit_rows
        self.span_input = t.bidirectional_vision  # (DecoderModule.span_input: the sliding layers read the spans)
        self.window = t.window
        self.attention = ATTENTION_KINDS[attention]
        self.layers = nn.ModuleList(Gemma4Layer(t, i) for i in range(t.layers))
        self.norm = Gemma4RMSNorm(t.hidden, t.eps)
        self.lm_head = nn.Linear(t.hidden, t.vocab, bias=False)
        if t.per_layer:
            self.per_layer_model_projection = nn.Linear(t.hidden, t.per_layer_width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(t.per_layer, t.eps)
        self.rope_table(4096)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's cache kind: "shared_kv" for the kv-shared layers, else its attention type's (a sliding
        layer's: "windowed_attention" where the graph takes a windowed cache, window_capacity, else
        "sliding_attention")."""
        sliding = "windowed_attention" if self.window_capacity else "sliding_attention"
        return tuple("shared_kv" if s.shares >= 0 else (sliding if s.type == "sliding_attention" else "attention")
                     for s in self.text.shapes)

    def kv_source(self, i: int) -> int:
        return self.text.shapes[i].shares

    def layer_weights(self, i: int) -> tuple[str, ...]:
        """A k_eq_v layer has no v_proj (the values are the key projection)."""
        names = super().layer_weights(i)
        return tuple(n for n in names if n != "self_attn.v_proj") if self.text.shapes[i].k_eq_v else names

    def with_options(self, *, attention: str, logit_rows: bool, rope_positions: int) -> "Gemma4Decoder":
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {attention!r}; one of {', '.join(ATTENTION_KINDS)}")
        with torch.device("meta"):  # (no weights of its own: it takes these, not a copy)
            new = Gemma4Decoder(self.text, logit_rows=logit_rows, attention=attention)
        new.load_state_dict(self.state_dict(), assign=True)
        new.rope_table(rope_positions)
        new.unit_norms()
        return new.eval()

    def unit_norms(self) -> None:
        """The weightless norms' ones (buffers, not in the state dict: built on the meta device with the module)."""
        for m in self.modules():
            if isinstance(m, Gemma4RMSNorm) and m.weight is None:
                m.ones = torch.ones(m.ones.shape)

    def rope_table(self, positions: int) -> None:
        """cos / sin [positions, head_dim / 2] per layer type (its theta, head_dim and rotating share), in fp32 as
        transformers computes them per step: GroupQueryAttention gathers the rows at the positions."""
        for kind, rope in self.text.ropes.items():
            d = next((s.head_dim for s in self.text.shapes if s.type == kind), self.text.head_dim)
            freqs = torch.arange(positions).float()[:, None] * rope.frequencies(d)[None, :]
            self.register_buffer(f"cos_{kind}", freqs.cos(), persistent=False)
            self.register_buffer(f"sin_{kind}", freqs.sin(), persistent=False)

    def forward(self, inputs_embeds, position_ids, *rest):
        t, kind = self.text, self.attention
        spans = None
        if self.span_input:
            spans, *rest = rest  # [ar] int64: each row's image span, -1 for none
        n_step = len(kind.step_inputs)
        step, state = rest[:n_step], rest[n_step:]
        if self.logit_rows:
            *state, rows = state
        dt = inputs_embeds.dtype
        if n_step == 2:  # gqa_in_place: the op rotates at the positions, the window is its local_window_size
            ropes = {k: (position_ids, getattr(self, f"cos_{k}").to(dt), getattr(self, f"sin_{k}").to(dt))
                     for k in t.ropes}
            steps = {k: step for k in t.ropes}
        else:  # the rows kinds: cos / sin rows at the positions; the sliding layers' mask has the window too
            ropes = {k: tuple(torch.cat([c, c], -1) for c in (getattr(self, f"cos_{k}")[position_ids[0]].to(dt),
                                                                  getattr(self, f"sin_{k}")[position_ids[0]].to(dt)))
                     for k in t.ropes}
            steps = {"full_attention": step, "sliding_attention": (self._windowed(step[0], spans),)}
            spans = None  # (in the sliding mask)
        e = kind.enter(inputs_embeds)  # [1, ar, hidden + L·P] (gqa_in_place) or [ar, ...]
        x = e[..., : t.hidden]
        per_layer = None
        if t.per_layer:
            proj = self.per_layer_model_projection(x) * t.hidden ** -0.5
            lead = (1, -1) if x.dim() == 3 else (-1,)  # gqa_in_place's [1, ar] rows (a batch: [B, ar / B]), or [ar]
            proj = self.per_layer_projection_norm(proj.view(*lead, t.layers, t.per_layer))
            per_layer = (proj + e[..., t.hidden:].view(*lead, t.layers, t.per_layer)) * 2.0 ** -0.5
        new, at, kept = [], 0, {}
        for i, (layer, cache) in enumerate(zip(self.layers, self.layer_kinds)):
            if cache == "shared_kv":
                kv = kept[self.kv_source(i)]
            else:
                kv = tuple(state[at:at + 2])
                at += 2
            pli = per_layer[..., i, :] if per_layer is not None else None
            x, pk, pv, k, v = layer(x, pli, ropes[layer.type], steps[layer.type], kv,
                                    spans if layer.type == "sliding_attention" else None, self.window_capacity)
            if cache != "shared_kv":
                new += [pk, pv]
                kept[i] = (kv[0], kv[1], k, v)
        x = kind.leave(x)
        if self.logit_rows:
            x = x.index_select(0, rows)
        logits = self.lm_head(self.norm(x))
        if t.softcap:
            logits = torch.tanh(logits / t.softcap) * t.softcap
        return (logits, *new, logits.argmax(-1)) if kind.argmax else (logits, *new)

    def _windowed(self, mask, spans=None):
        """The rows kinds' mask [ar, ctx + ar] with the sliding window too: the step's first slot is the count of
        cache slots row 0 sees (the mask is built from slots: 0 for slots before the step's), query i is at that +
        i, a cache column j at slot j, a new column at the step's slot + its row; a key at slot k <= q - window is
        masked with the mask's own hidden value (its lowest entry: the dtype's lowest on the CPU, the HTP bundle's
        moderate mask_value, which a 16-bit range must hold; -100 where the mask hides nothing; combined by min, not
        added). spans [ar]: a row of a span also sees the span's later rows of the step (bidirectional vision
        attention)."""
        ar = mask.shape[0]
        ctx = mask.shape[1] - ar
        if spans is not None:
            own = (spans[:, None] == spans[None, :]) & (spans[:, None] >= 0)  # [ar, ar]
            opened = torch.cat([torch.zeros(ar, ctx, dtype=torch.bool), own], dim=1)
            mask = torch.where(opened, torch.zeros((), dtype=mask.dtype), mask)
        first = (mask[0, :ctx] == 0).sum()
        q = first + torch.arange(ar)
        k = torch.cat([torch.arange(ctx), q])
        out = k[None, :] <= q[:, None] - self.window
        hidden = torch.clamp(mask.min(), max=-100.0)
        return torch.minimum(mask, torch.where(out, hidden, torch.zeros((), dtype=mask.dtype)))


def load(t: Gemma4TextConfig, take, prefix: str) -> tuple[Gemma4Decoder, TokenTable]:
    """The decoder from the checkpoint's tensors under prefix (`model.language_model.`, or `model.` for a text-only
    checkpoint) and the host's token table [vocab, hidden + L·P] (module doc), as row blocks read from the
    checkpoint's tensors (token_table.py: 11 GB as float32 at E2B). The lm head is the embedding (Gemma 4 ties
    them). The module is built without weights of its own (the meta device) and takes the checkpoint's: one float32
    copy of each weight."""
    embed = take.stored(prefix + "embed_tokens.weight")
    with torch.device("meta"):
        dec = Gemma4Decoder(t)
    names = [n for n in dec.state_dict() if not n.startswith("lm_head.")]
    sd = {n: take(prefix + n) for n in names}
    sd["lm_head.weight"] = embed.float()
    dec.load_state_dict(sd, strict=True, assign=True)
    dec.rope_table(4096)  # (its buffers: not in the state dict, built on the meta device above)
    dec.unit_norms()
    parts = [(embed, t.hidden ** 0.5)]
    if t.per_layer:
        rows = take.stored(prefix + "embed_tokens_per_layer.weight")  # [per_layer_vocab, L·P]
        if rows.shape[0] < t.vocab:  # (ids past the per-layer vocabulary: none in the released checkpoints)
            raise ValueError(f"the per-layer table has {rows.shape[0]} rows for a vocabulary of {t.vocab}")
        parts.append((rows, t.per_layer ** 0.5))
    return dec.eval(), TokenTable(parts, t.vocab)
