"""Ops written once for static export: no data-dependent control flow, 2-D [seq, dim] I/O.

Decoder attention follows ExecuTorch's static attention: the KV cache is an input
[max_context, kv_dim] per layer (rows addressed by absolute position), the graph attends
over concat(cache, new rows) under a host-built additive mask and returns only the new
rows. runtime/kv_cache.py writes them back; tests/test_kv_contract.py holds the two together.
The CPU target's one-graph decoder takes the other contract (in_place): attention is one ORT GroupQueryAttention
(families/gqa.py) that applies RoPE and writes the new rows into the cache buffers [1, kv_heads, max_context, d]
itself, given the step's total length instead of positions + mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import gqa  # noqa: F401  (registers torch.ops.vlmrt.group_query_attention)
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
    """Grouped-query attention over an external cache; returns output and the new K/V rows."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm: bool = False, eps: float = 1e-6, copy_free: bool = True, in_place: bool = False,
                 o_bias: bool = False):
        """copy_free: steps read the cache where it is (_copy_free_step); the HTP target's float graphs do not.
        in_place: forward(x, seqlens_k, total, cos_half, sin_half, past_k, past_v) -> (out, present_k, present_v)
        as one GroupQueryAttention over cache buffers [1, kv_heads, max_context, d] (module doc)."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.copy_free = heads, kv_heads, head_dim, copy_free
        self.in_place = in_place
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)  # Qwen2: q/k/v biases
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)  # Llama / Qwen3 attention_bias: o_proj's too
        # Qwen3: RMSNorm over each head's q and k before RoPE
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(self, x, *cache):
        return self._in_place_step(x, *cache) if self.in_place else self._rows_step(x, *cache)

    def _in_place_step(self, x, seqlens_k, total, cos, sin, past_k, past_v):
        # x [1, ar, hidden] (the op's layout: no reshapes around it); cos/sin [positions, head_dim/2];
        # past_k/v [1, kv_heads, max_context, head_dim]
        ar, h, kvh, d = x.shape[1], self.heads, self.kv_heads, self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)  # [1, ar, h*d], [1, ar, kvh*d]
        if not isinstance(self.q_norm, nn.Identity):  # Qwen3's q/k norms per head come before RoPE, which the op applies
            q = self.q_norm(q.view(1, ar, h, d)).reshape(1, ar, h * d)
            k = self.k_norm(k.view(1, ar, kvh, d)).reshape(1, ar, kvh * d)
        out, pk, pv = torch.ops.vlmrt.group_query_attention(q, k, self.v_proj(x), past_k, past_v, seqlens_k, total,
                                                            cos, sin, h, kvh)
        return self.o_proj(out), pk, pv

    def _rows_step(self, x, cos, sin, mask, past_k, past_v):
        # x [ar, hidden]; mask [ar, ctx+ar]; past_k/v [ctx, kv_heads*head_dim]
        ar = x.shape[0]
        ctx = past_k.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        rep = h // kvh
        q = apply_rope(self.q_norm(self.q_proj(x).view(ar, h, d)), cos, sin)  # [ar, h, d]
        k_new = apply_rope(self.k_norm(self.k_proj(x).view(ar, kvh, d)), cos, sin)  # [ar, kvh, d]
        v_new = self.v_proj(x).view(ar, kvh, d)
        if self.copy_free:
            return self._copy_free_step(q, k_new, v_new, mask, past_k, past_v)
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
        return self.o_proj(out), k_new.reshape(ar, kvh * d), v_new.reshape(ar, kvh * d)

    def _copy_free_step(self, q, k_new, v_new, mask, past_k, past_v):
        """Attention without copying the cache, for any AR: concat + permute of [ctx, kv_dim] (above) copies
        every layer's K and V on every step, more bytes than the 4-bit weights at 512 slots. Here both cache
        products are 2-D MatMuls on the cache as it is (q·Kᵀ becomes ORT's FusedMatMul with transB): each
        token's q is spread block-diagonally over the kv heads' columns, so [ar*h, kv_dim] @ [kv_dim, ctx]
        gives each head its group's scores (kv_heads× the FLOPs of a small product), and probs @ V
        [ctx, kv_dim] is read back on the diagonal blocks. The step's own keys/values are a separate
        [kvh, rep, ar, ar] product. One formulation for every AR, so one graph can serve prefill and decode."""
        ar, ctx = q.shape[0], past_k.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
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
        return self.o_proj(out.reshape(ar, h * d)), k_new.reshape(ar, kvh * d), v_new.reshape(ar, kvh * d)


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
                 copy_free=True, in_place=False, o_bias=False, mlp_bias=False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = CachedGQAttention(hidden, heads, kv_heads, head_dim, bias=qkv_bias, qk_norm=qk_norm, eps=eps,
                                           copy_free=copy_free, in_place=in_place, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate, act, mlp_bias)

    def forward(self, x, *cache):
        a, k_new, v_new = self.self_attn(self.input_layernorm(x), *cache)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_new, v_new


class CausalDecoder(nn.Module):
    """Decoder stack + final norm + lm head: one static step over `ar` tokens.

    forward(inputs_embeds [ar, hidden], position_ids [ar], attention_mask [ar, ctx+ar],
            *past (k_0, v_0, k_1, v_1, ...) each [ctx, kv_dim])
      -> (logits [ar, vocab], new_k_0, new_v_0, ...) each new row block [ar, kv_dim]
    With logit_rows the graph takes one more input after the cache, logit_rows [r] (int64 row indices), and the
    logits are [r, vocab], those rows' only (the LM head is skipped for the rest): a prefill block asks for its last
    row, a lookahead verify step for all (runtime/lookahead.py). copy_free: see CachedGQAttention. Both are graph
    options: `with_options` builds the same weights with others.
    in_place (the CPU one-graph decoder; needs logit_rows): forward(inputs_embeds, seqlens_k [1] int32,
    total_sequence_length [] int32, *past each [1, kv_heads, max_context, head_dim], logit_rows)
      -> (logits, present_k_0, present_v_0, ..., next_token) each present the shape of its past, the step's rows
    written in (families/gqa.py); next_token [r] int64 = each logits row's argmax (the greedy choice, made in the
    graph while the logits are in cache); the step's tokens are at positions total - ar .. total - 1.
    """

    def __init__(self, *, layers, hidden, heads, kv_heads, head_dim, intermediate, eps, act, rope: Rope, vocab,
                 qkv_bias=False, qk_norm=False, copy_free=True, logit_rows=False, in_place=False,
                 o_bias=False, mlp_bias=False):
        """rope: a rope.Rope (base theta, scaling type). o_bias, mlp_bias: biases on o_proj and on the MLP's
        projections (Llama's attention_bias / mlp_bias)."""
        super().__init__()
        self.shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          intermediate=intermediate, eps=eps, act=act, vocab=vocab,
                          qkv_bias=qkv_bias, qk_norm=qk_norm, rope=rope, o_bias=o_bias, mlp_bias=mlp_bias)
        self.logit_rows, self.in_place = logit_rows, in_place
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, heads, kv_heads, head_dim, intermediate, eps, act, qkv_bias, qk_norm, copy_free, in_place,
                         o_bias, mlp_bias)
            for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv_freq, self.rope_scale = rope.frequencies(head_dim)  # rope_scale: yarn's attention factor on cos/sin
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_table(4096)

    def with_options(self, *, copy_free: bool, logit_rows: bool, rope_positions: int,
                     in_place: bool = False) -> "CausalDecoder":
        """A new decoder with a copy of these weights, built with other graph options and a rope table of
        rope_positions rows."""
        new = CausalDecoder(**self.shape, copy_free=copy_free, logit_rows=logit_rows, in_place=in_place)
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

    def forward(self, inputs_embeds, step_a, step_b, *past):
        """step_a, step_b: position_ids, attention_mask; in_place: seqlens_k, total_sequence_length."""
        if self.logit_rows:
            *past, rows = past  # rows [r] int64
        if self.in_place:  # the op's cos/sin caches [positions, head_dim/2] (the table's halves are equal)
            half = self.rope_cos.shape[1] // 2
            shared = (step_a, step_b, self.rope_cos[:, :half].to(inputs_embeds.dtype),
                      self.rope_sin[:, :half].to(inputs_embeds.dtype))
        else:
            cos = self.rope_cos[step_a].to(inputs_embeds.dtype)  # [ar, head_dim]
            sin = self.rope_sin[step_a].to(inputs_embeds.dtype)
            shared = (cos, sin, step_b)
        x = inputs_embeds[None] if self.in_place else inputs_embeds  # in_place: [1, ar, hidden] throughout
        new = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, *shared, past[2 * i], past[2 * i + 1])
            new += [k, v]
        x = x[0] if self.in_place else x
        if self.logit_rows:
            x = x.index_select(0, rows)  # [r, hidden]
        logits = self.lm_head(self.norm(x))
        return (logits, *new, logits.argmax(-1)) if self.in_place else (logits, *new)
