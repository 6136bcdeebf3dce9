"""Ops written once for static export: no data-dependent control flow, 2-D [seq, dim] I/O.

Decoder attention follows ExecuTorch's static attention: the KV cache lives outside the graph and the ways a graph
steps over it are attention kinds registered by name (ATTENTION_KINDS, register_attention). Every kind takes the
rope positions as an input [rows, ar] computed by the host, apart from the cache slots a step's rows go to.
  rows_copy_free / rows_concat  the rows contract: the cache is an input [ctx, kv_dim] per layer (rows by slot),
      the graph attends over it and the step's rows under a host-built additive mask (from slots) and returns only
      the new rows, which runtime/decode/kv_cache.py writes back (copy-free for the CPU, concat for the HTP's float graphs)
  gqa_in_place  one ORT GroupQueryAttention (families/gqa.py) per layer that applies RoPE at the positions (M-RoPE's
      rows gathered first into a table of the step's own, _gqa_rope) and writes the new rows into the cache buffers
      [1, kv_heads, max_context, d] itself, given the step's end slot instead of a mask
tests/test_kv_contract.py holds graph and host together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import DecoderModule, gqa  # noqa: F401  (gqa registers torch.ops.vlmrt.group_query_attention)
from .rope import Rope


class RMSNorm(nn.Module):
    # mirrors transformers LlamaRMSNorm: normalize in fp32, then scale
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[:, None].float() * inv_freq[None, :]  # [seq, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [seq, heads, head_dim]; cos/sin [seq, head_dim]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class CachedGQAttention(nn.Module):
    """Grouped-query attention over an external cache: the weights (q/k/v/o projections, Qwen3's q/k norms); how a
    step attends is the decoder's attention kind (ATTENTION_KINDS), handed to forward."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm: bool = False, eps: float = 1e-6, o_bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)  # Qwen2: q/k/v biases
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)  # Llama / Qwen3 attention_bias: o_proj's too
        # Qwen3: RMSNorm over each head's q and k before RoPE
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(self, x, kind: "AttentionKind", rope, step, past_k, past_v):
        """x: the step's rows in the kind's layout; rope: kind.rotary's; step: the kind's step inputs (a tuple)."""
        return kind.body(self, x, rope, step, past_k, past_v)


@dataclass(frozen=True)
class AttentionKind:
    """One way a decoder graph's attention steps over the cache, registered by name (ExecuTorch's register_attention):
    the graph inputs it takes after inputs_embeds and position_ids (`step_inputs`), how the rope positions become the
    rotation it applies (`rotary(decoder, positions [rows, ar], dtype)`), the layout of the rows between layers
    (`enter` / `leave`), whether the graph also returns each logits row's argmax, and the body
    (attn, x, rope, step, past_k, past_v) -> (out, k_out, v_out)."""

    name: str
    step_inputs: tuple[str, ...]
    rotary: Callable
    body: Callable
    enter: Callable = lambda x: x  # noqa: E731
    leave: Callable = lambda x: x  # noqa: E731
    argmax: bool = False  # (the gqa_in_place kind's argmax_output: the greedy choice made while the logits are in cache)


ATTENTION_KINDS: dict[str, AttentionKind] = {}


def register_attention(kind: AttentionKind) -> AttentionKind:
    ATTENTION_KINDS[kind.name] = kind
    return kind


def _gathered_rope(decoder, positions, dtype):
    """cos/sin [ar, head_dim] of the table rows at the positions: one rope row, positions[0]; several (M-RoPE), each
    frequency's angle from the row decoder.rope_pick assigns it (a one-hot [rows, 1, head_dim]: one term of each sum
    is non-zero, so the gather is exact)."""
    pick = decoder.rope_pick  # (None: one rope row; a family's own decoder may have no M-RoPE at all)
    if pick is None:
        return decoder.rope_cos[positions[0]].to(dtype), decoder.rope_sin[positions[0]].to(dtype)
    return ((decoder.rope_cos[positions] * pick).sum(0).to(dtype), (decoder.rope_sin[positions] * pick).sum(0).to(dtype))


def _rows_qkv(attn, x, rope):
    # x [ar, hidden] -> q [ar, h, d], k_new / v_new [ar, kvh, d], RoPE applied to q and k
    ar, h, kvh, d = x.shape[0], attn.heads, attn.kv_heads, attn.head_dim
    cos, sin = rope
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(ar, h, d)), cos, sin)
    k_new = apply_rope(attn.k_norm(attn.k_proj(x).view(ar, kvh, d)), cos, sin)
    return q, k_new, attn.v_proj(x).view(ar, kvh, d)


def _concat_body(attn, x, rope, step, past_k, past_v):
    """The rows contract as concat + transpose of the cache (the HTP target's float graphs): x [ar, hidden];
    step (mask [ar, ctx+ar],); past_k/v [ctx, kv_heads*head_dim] -> out, the new rows [ar, kv_dim] each."""
    (mask,) = step
    q, k_new, v_new = _rows_qkv(attn, x, rope)
    ar, ctx = x.shape[0], past_k.shape[0]
    h, kvh, d = attn.heads, attn.kv_heads, attn.head_dim
    rep = h // kvh
    k = torch.cat([past_k.view(ctx, kvh, d), k_new], dim=0).permute(1, 2, 0)[:, None]  # [kvh, 1, d, ctx+ar]
    v = torch.cat([past_v.view(ctx, kvh, d), v_new], dim=0).transpose(0, 1)[:, None]  # [kvh, 1, ctx+ar, d]
    # query head j uses kv head j // rep (transformers' repeat_kv): group queries per kv head.
    # Keep the matmuls 4-D: onnxscript's optimizer folds a reshape->3-D matmul->reshape chain
    # into a 4-D x 3-D MatMul that broadcasts over the wrong axis when kv_heads == rep.
    q = q.view(ar, kvh, rep, d).permute(1, 2, 0, 3)  # [kvh, rep, ar, d]
    scores = torch.matmul(q, k) * (1.0 / math.sqrt(d)) + mask  # [kvh, rep, ar, ctx+ar]
    probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
    out = torch.matmul(probs, v)  # [kvh, rep, ar, d]
    out = out.permute(2, 0, 1, 3).reshape(ar, h * d)
    return attn.o_proj(out), k_new.reshape(ar, kvh * d), v_new.reshape(ar, kvh * d)


def _copy_free_body(attn, x, rope, step, past_k, past_v):
    """The rows contract without copying the cache, for any AR: concat + permute of [ctx, kv_dim] (_concat_body)
    copies every layer's K and V on every step, more bytes than the 4-bit weights at 512 slots. Here both cache
    products are 2-D MatMuls on the cache as it is (q·Kᵀ becomes ORT's FusedMatMul with transB): each
    token's q is spread block-diagonally over the kv heads' columns, so [ar*h, kv_dim] @ [kv_dim, ctx]
    gives each head its group's scores (kv_heads× the FLOPs of a small product), and probs @ V
    [ctx, kv_dim] is read back on the diagonal blocks. The step's own keys/values are a separate
    [kvh, rep, ar, ar] product. One formulation for every AR, so one graph can serve prefill and decode."""
    (mask,) = step
    q, k_new, v_new = _rows_qkv(attn, x, rope)
    ar, ctx = q.shape[0], past_k.shape[0]
    h, kvh, d = attn.heads, attn.kv_heads, attn.head_dim
    rep = h // kvh
    sel = torch.eye(kvh, dtype=q.dtype)[None, :, None, :, None]  # [1, group, 1, kv head, 1]
    qg = q.view(ar, kvh, rep, d)  # head j = (group j // rep, j % rep)
    qx = (qg[:, :, :, None, :] * sel).reshape(ar * h, kvh * d)  # block-diagonal per token
    s_past = torch.matmul(qx, past_k.transpose(0, 1)).view(ar, kvh, rep, ctx)
    s_new = torch.matmul(qg.permute(1, 2, 0, 3), k_new.permute(1, 2, 0)[:, None])  # [kvh, rep, ar, ar]
    scores = torch.cat([s_past, s_new.permute(2, 0, 1, 3)], dim=-1) * (1.0 / math.sqrt(d)) + mask[:, None, None, :]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [ar, kvh, rep, ctx+ar]
    o_past = torch.matmul(probs[..., :ctx].reshape(ar * h, ctx), past_v).view(ar, kvh, rep, kvh, d)
    o_past = (o_past * sel).sum(3)  # diagonal blocks: [ar, kvh, rep, d]
    o_new = torch.matmul(probs[..., ctx:].permute(1, 2, 0, 3), v_new.transpose(0, 1)[:, None])  # [kvh, rep, ar, d]
    out = o_past + o_new.permute(2, 0, 1, 3)
    return attn.o_proj(out.reshape(ar, h * d)), k_new.reshape(ar, kvh * d), v_new.reshape(ar, kvh * d)


def _gqa_rope(decoder, positions, dtype):
    """GroupQueryAttention's rotary: its position_ids [1, ar] and cos/sin caches [rows, head_dim/2] (the table's
    halves are equal). One rope row: the positions themselves over the whole table. Several (M-RoPE): the op rotates
    each token by one position, so the graph gathers each token's angles first (_gathered_rope) into a table of the
    step's own, token i at row i, and the op's position_ids are 0..ar-1 (which is also what ORT reads on a step at
    slot 0, its "first prompt": any positions then); the table is padded with zero rows to ar + the table length
    (the op wants as many rows as the step's total length)."""
    half = decoder.rope_cos.shape[1] // 2
    if decoder.rope_pick is None:
        return positions, decoder.rope_cos[:, :half].to(dtype), decoder.rope_sin[:, :half].to(dtype)
    cos, sin = _gathered_rope(decoder, positions, dtype)  # [ar, head_dim]
    pad = torch.zeros(decoder.rope_cos.shape[0], half, dtype=dtype)  # [max_context, head_dim/2]
    ids = torch.arange(positions.shape[1], dtype=torch.int64).unsqueeze(0)  # [1, ar]: token i -> row i
    return ids, torch.cat([cos[:, :half], pad]), torch.cat([sin[:, :half], pad])


def _gqa_body(attn, x, rope, step, past_k, past_v):
    """One ORT GroupQueryAttention (families/gqa.py) that applies RoPE at the positions and writes the step's rows
    into the cache buffers at slots total - ar .. total - 1: x [1, ar, hidden] (the op's layout: no reshapes
    around it); step (seqlens_k [1], total []) int32; past_k/v [1, kv_heads, max_context, head_dim] ->
    out, present_k, present_v (the buffers, updated)."""
    seqlens_k, total = step
    positions, cos, sin = rope
    ar, h, kvh, d = x.shape[1], attn.heads, attn.kv_heads, attn.head_dim
    q, k = attn.q_proj(x), attn.k_proj(x)  # [1, ar, h*d], [1, ar, kvh*d]
    if not isinstance(attn.q_norm, nn.Identity):  # Qwen3's q/k norms per head come before RoPE, which the op applies
        q = attn.q_norm(q.view(1, ar, h, d)).reshape(1, ar, h * d)
        k = attn.k_norm(k.view(1, ar, kvh, d)).reshape(1, ar, kvh * d)
    out, pk, pv = torch.ops.vlmrt.group_query_attention(q, k, attn.v_proj(x), past_k, past_v, seqlens_k, total,
                                                        cos, sin, positions, h, kvh)
    return attn.o_proj(out), pk, pv


register_attention(AttentionKind("rows_copy_free", ("attention_mask",), _gathered_rope, _copy_free_body))
register_attention(AttentionKind("rows_concat", ("attention_mask",), _gathered_rope, _concat_body))
register_attention(AttentionKind("gqa_in_place", ("seqlens_k", "total_sequence_length"), _gqa_rope, _gqa_body,
                                 enter=lambda x: x[None], leave=lambda x: x[0], argmax=True))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)  # Llama mlp_bias
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama/Qwen block with cache I/O."""

    def __init__(self, hidden, heads, kv_heads, head_dim, intermediate, eps, act, qkv_bias=False, qk_norm=False,
                 o_bias=False, mlp_bias=False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = CachedGQAttention(hidden, heads, kv_heads, head_dim, bias=qkv_bias, qk_norm=qk_norm, eps=eps,
                                           o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate, act, mlp_bias)

    def forward(self, x, kind, rope, step, past_k, past_v):
        a, k_new, v_new = self.self_attn(self.input_layernorm(x), kind, rope, step, past_k, past_v)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_new, v_new


class CausalDecoder(nn.Module, DecoderModule):
    """Decoder stack + final norm + lm head: one static step over `ar` tokens.

    forward(inputs_embeds [ar, hidden], position_ids [1, ar] int64 (the rope positions, computed by the host),
            *step (the attention kind's step_inputs), *past (k_0, v_0, k_1, v_1, ...)[, logit_rows [r] int64])
      -> (logits, k_out_0, v_out_0, ...[, next_token [r] int64])
    The attention kind (ATTENTION_KINDS, by name) says what step and past are and what comes out:
      rows_copy_free, rows_concat  step = (attention_mask [ar, ctx+ar],), past each [ctx, kv_dim]; out: the step's
                                   new rows [ar, kv_dim] (the host writes them into its cache)
      gqa_in_place                 step = (seqlens_k [1] int32, total_sequence_length [] int32), past each
                                   [1, kv_heads, max_context, head_dim]; out: the buffers with the step's rows
                                   written in at slots total - ar .. total - 1 (families/gqa.py), then next_token
                                   [r] = each logits row's argmax (the greedy choice, made in the graph)
    rope_rows: the rope row (0 .. rows-1) of each of the head_dim/2 frequencies (M-RoPE: Qwen2.5-VL / Qwen3-VL's
    sections, families/qwen_vl/config.py MRope.rows); position_ids is then [rows, ar]. None: one row.
    row_levels > 0 (Qwen3-VL's DeepStack): the graph takes one more input after position_ids, row_input
    [ar, row_levels * hidden], whose level i is added to the hidden rows after decoder layer i (zero rows: nothing).
    With logit_rows the graph takes logit_rows [r] (int64 row indices) last and the logits are [r, vocab], those rows'
    only (the LM head is skipped for the rest): a prefill block asks for its last row, a lookahead verify step for
    all (runtime/decode/lookahead.py); without it logits are [ar, vocab]. Both are graph options: `with_options` builds
    the same weights with others.
    """

    def __init__(self, *, layers, hidden, heads, kv_heads, head_dim, intermediate, eps, act, rope: Rope, vocab,
                 qkv_bias=False, qk_norm=False, attention: str = "rows_copy_free", logit_rows=False,
                 o_bias=False, mlp_bias=False, rope_rows: tuple[int, ...] | None = None, row_levels: int = 0):
        """rope: a rope.Rope (base theta, scaling type). attention: an ATTENTION_KINDS name. o_bias, mlp_bias: biases
        on o_proj and on the MLP's projections (Llama's attention_bias / mlp_bias)."""
        super().__init__()
        self.shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          intermediate=intermediate, eps=eps, act=act, vocab=vocab,
                          qkv_bias=qkv_bias, qk_norm=qk_norm, rope=rope, o_bias=o_bias, mlp_bias=mlp_bias,
                          rope_rows=rope_rows, row_levels=row_levels)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {attention!r}; one of {', '.join(ATTENTION_KINDS)}")
        self.attention, self.logit_rows = ATTENTION_KINDS[attention], logit_rows
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, heads, kv_heads, head_dim, intermediate, eps, act, qkv_bias, qk_norm, o_bias, mlp_bias)
            for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv_freq, self.rope_scale = rope.frequencies(head_dim)  # rope_scale: yarn's attention factor on cos/sin
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.row_levels = row_levels
        self.rope_rows = 1 if rope_rows is None else max(rope_rows) + 1
        if rope_rows is not None and len(rope_rows) != head_dim // 2:
            raise ValueError(f"rope_rows names {len(rope_rows)} frequencies, head_dim {head_dim} has {head_dim // 2}")
        pick = None
        if rope_rows is not None:  # [rows, 1, head_dim]: the halves of the table are the same frequencies
            r = torch.tensor(list(rope_rows) * 2)
            pick = (r[None, None, :] == torch.arange(self.rope_rows)[:, None, None]).float()
        self.register_buffer("rope_pick", pick, persistent=False)
        self.rope_table(4096)

    def with_options(self, *, attention: str, logit_rows: bool, rope_positions: int) -> "CausalDecoder":
        """A new decoder with a copy of these weights, built with other graph options and a rope table of
        rope_positions rows."""
        new = CausalDecoder(**self.shape, attention=attention, logit_rows=logit_rows)
        new.load_state_dict(self.state_dict())
        new.rope_table(rope_positions)
        return new.eval()

    def rope_table(self, positions: int) -> None:
        """Precompute cos/sin [positions, head_dim] (in fp32, as transformers does per step): the graph
        gathers rows by position instead of running Sin/Cos — exact, cheaper, and NPU-friendly
        (the HTP's 16-bit Sin/Cos of large angles is not). Export sizes it to max context + AR."""
        cos, sin = rope_cos_sin(torch.arange(positions), self.inv_freq)
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, inputs_embeds, position_ids, *rest):
        kind = self.attention
        if self.row_levels:
            row_input, *rest = rest  # [ar, row_levels * hidden]
        n_step = len(kind.step_inputs)
        step, past = rest[:n_step], rest[n_step:]
        if self.logit_rows:
            *past, rows = past  # rows [r] int64
        rope = kind.rotary(self, position_ids, inputs_embeds.dtype)
        x = kind.enter(inputs_embeds)
        hidden = inputs_embeds.shape[-1]
        new = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, kind, rope, step, past[2 * i], past[2 * i + 1])
            if i < self.row_levels:  # DeepStack: this level's vision features on the image rows
                x = x + kind.enter(row_input[:, i * hidden:(i + 1) * hidden])
            new += [k, v]
        x = kind.leave(x)
        if self.logit_rows:
            x = x.index_select(0, rows)  # [r, hidden]
        logits = self.lm_head(self.norm(x))
        return (logits, *new, logits.argmax(-1)) if kind.argmax else (logits, *new)
