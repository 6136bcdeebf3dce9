"""ORT's com.microsoft GroupQueryAttention as a torch op, so that the CPU decoder exports attention as one node.

    out, present_k, present_v = torch.ops.vlmrt.group_query_attention(
        q [1, s, heads*d], k [1, s, kv_heads*d], v [1, s, kv_heads*d],      (before RoPE)
        past_k [1, kv_heads, max_context, d], past_v [...],                 (the cache, post-RoPE keys)
        seqlens_k [1] int32 (= total - 1), total [] int32 (= past + s),
        cos [table rows, d/2], sin [table rows, d/2], position_ids [1, s] int64, heads, kv_heads[, window, scale,
        spans, capacity])

The s new tokens go to cache slots total - s .. total - 1: RoPE (rotate-half, transformers' form) is applied to q
and k at their position_ids (the rope positions, which need not be the slots), their K/V rows are written into
present at those slots, and each new token attends to slots 0..its own slot (causal inside the block).
scale: the scores' factor (0: 1/sqrt(d), the op's default; Gemma 4's 1). ORT 1.32
reads position_ids per token except on a step that starts at slot 0 (its "first prompt"), where it rotates token i
by position_ids[0] + i; the runtime refuses other positions there (runtime/decode/decoder_kinds.py). `present` has the shape of `past`: the runtime binds both to one
buffer, so the graph updates the cache in place (ORT's past/present share-buffer mode). export/gqa_onnx.py maps
the op onto the ORT node; the eager version below is its reference (tests/test_gqa.py).

A sliding window (window > 0: a token attends only to slots q - window < k <= q, the node's local_window_size =
window) takes a windowed cache (capacity > 0, ORT's sliding_window_cache): past / present are [1, kv_heads,
capacity, d] and hold the last L(T) slots in rows [0, L(T)) (format/manifest.py `resident`), the op evicting in the
graph; `present` is then another buffer than `past` (the runtime keeps the step's in a staging buffer: the state
before the call stays, and a kv-shared layer reads its source's `past` unchanged). spans [s] int64 (None: none, with
a window only): each new token's span (a run of image tokens; -1: none); a token of a span also sees the span's later
tokens of the step (a span is never split across steps: runtime/decode/spans.py), the window still applied (slots
k > q - window): export/gqa_onnx.py then writes a second node, causal 0 with an attention_bias built from slots and
spans in the graph.
"""

from __future__ import annotations

import math

import torch

from ..format.manifest import resident


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, s, d]; cos/sin [s, d/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@torch.library.custom_op("vlmrt::group_query_attention", mutates_args=())
def group_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                          past_v: torch.Tensor, seqlens_k: torch.Tensor, total: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, position_ids: torch.Tensor, heads: int, kv_heads: int, window: int = 0,
                          scale: float = 0.0, spans: torch.Tensor | None = None, capacity: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if capacity:
        return _windowed(q, k, v, past_k, past_v, int(total), cos, sin, position_ids, heads, kv_heads, window, scale,
                         spans)
    if window or spans is not None:
        raise ValueError("a sliding window (and spans) take a windowed cache: capacity > 0")
    s, d = q.shape[1], past_k.shape[-1]
    n = int(total)
    pos = torch.arange(n - s, n)  # the slots
    c, si = cos[position_ids[0]].to(q.dtype), sin[position_ids[0]].to(q.dtype)  # [s, d/2]
    qh = _rope(q[0].view(s, heads, d).transpose(0, 1), c, si)  # [heads, s, d]
    kh = _rope(k[0].view(s, kv_heads, d).transpose(0, 1), c, si)  # [kv_heads, s, d]
    present_k, present_v = past_k.clone(), past_v.clone()
    present_k[0, :, n - s : n] = kh
    present_v[0, :, n - s : n] = v[0].view(s, kv_heads, d).transpose(0, 1)
    keys = present_k[0, :, :n].repeat_interleave(heads // kv_heads, 0)  # [heads, n, d]
    values = present_v[0, :, :n].repeat_interleave(heads // kv_heads, 0)
    scores = qh @ keys.transpose(1, 2) * (scale or 1 / math.sqrt(d))  # [heads, s, n]
    hidden = torch.arange(n)[None, :] > pos[:, None]  # [s, n]: slots after a token's position
    probs = torch.softmax(scores.float().masked_fill(hidden, float("-inf")), -1).to(q.dtype)
    out = (probs @ values).transpose(0, 1).reshape(1, s, heads * d)
    return out, present_k, present_v


def _windowed(q, k, v, past_k, past_v, n: int, cos, sin, position_ids, heads: int, kv_heads: int, window: int,
              scale: float, spans=None):
    """The op with a windowed cache (module doc): past holds slots p - L(p) .. p - 1 (p = n - s) in rows [0, L(p)),
    present the last L(n) of those and the step's; spans as the by-slot op's."""
    s, d, cap = q.shape[1], past_k.shape[-1], past_k.shape[2]
    p = n - s
    lp, ln = resident(p, cap, window), resident(n, cap, window)
    c, si = cos[position_ids[0]].to(q.dtype), sin[position_ids[0]].to(q.dtype)
    qh = _rope(q[0].view(s, heads, d).transpose(0, 1), c, si)
    kh = _rope(k[0].view(s, kv_heads, d).transpose(0, 1), c, si)
    keys = torch.cat([past_k[0, :, :lp], kh], 1)  # [kv_heads, lp + s, d]: slots p - lp .. n - 1
    values = torch.cat([past_v[0, :, :lp], v[0].view(s, kv_heads, d).transpose(0, 1)], 1)
    present_k, present_v = past_k.clone(), past_v.clone()
    present_k[0, :, :ln], present_v[0, :, :ln] = keys[:, lp + s - ln:], values[:, lp + s - ln:]
    slots = torch.arange(p - lp, n)
    qpos = torch.arange(p, n)
    hidden = slots[None, :] > qpos[:, None]
    if spans is not None:  # a span's later tokens of the step are seen
        own = torch.cat([torch.full((lp,), -1, dtype=spans.dtype), spans.reshape(-1)])
        hidden = hidden & ~((own[None, :] == spans.reshape(-1)[:, None]) & (spans.reshape(-1)[:, None] >= 0))
    hidden = hidden | (slots[None, :] <= qpos[:, None] - window)
    rep = heads // kv_heads
    scores = qh @ keys.repeat_interleave(rep, 0).transpose(1, 2) * (scale or 1 / math.sqrt(d))
    probs = torch.softmax(scores.float().masked_fill(hidden, float("-inf")), -1).to(q.dtype)
    out = (probs @ values.repeat_interleave(rep, 0)).transpose(0, 1).reshape(1, s, heads * d)
    return out, present_k, present_v


@group_query_attention.register_fake
def _(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, heads, kv_heads, window=0, scale=0.0,
      spans=None, capacity=0):
    return torch.empty_like(q), torch.empty_like(past_k), torch.empty_like(past_v)
