"""torch.ops.vlmrt.group_query_attention (families/gqa.py) -> one com.microsoft GroupQueryAttention node.

ORT's contrib ops have no schema in `onnx`, and the dynamo exporter builds a node only from a schema: this module
registers the op's schema (the inputs vlmrt uses, in ORT's order: docs/ContribOperators.md of onnxruntime) once, and
gives the exporter the translation (`TABLE`, torch.onnx.export's custom_translation_table). do_rotary with the cos /
sin caches applies RoPE at the host's position_ids (rotary_interleaved 0: transformers' rotate-half form); scale 1/sqrt(head_dim), ORT's default,
unless the op is given one; a sliding window as local_window_size over a windowed cache (capacity > 0: the buffers
hold the last slots, not one per slot) as sliding_window_cache 1. With spans (a token of an image span also sees the
span's later tokens: families/gqa.py) a second node takes causal 0 and an attention_bias [B, 1, s, total] built here
from the step's slots (seqlens_k, its rows) and spans: 0 where the key is at or before the query's slot or a token of
the query's span in the step, and within the window; the lowest value else (_windowed_spans).
`pack_qkv` then feeds the op the fused q/k/v projection whole (its packed-QKV form), without the Split between.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

from ..families import gqa  # noqa: F401  (registers the torch op)

DOMAIN = "com.microsoft"


def _register() -> None:
    if onnx.defs.has("GroupQueryAttention", DOMAIN):
        return
    p, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [p("query", "T"), p("key", "T", param_option=opt), p("value", "T", param_option=opt),
              p("past_key", "T", param_option=opt), p("past_value", "T", param_option=opt), p("seqlens_k", "M"),
              p("total_sequence_length", "M"), p("cos_cache", "T", param_option=opt),
              p("sin_cache", "T", param_option=opt), p("position_ids", "P", param_option=opt),
              p("attention_bias", "T", param_option=opt)]
    outputs = [p("output", "T"), p("present_key", "T"), p("present_value", "T")]
    a, at = OpSchema.Attribute, OpSchema.AttrType
    attributes = [a("num_heads", at.INT, "", required=True), a("kv_num_heads", at.INT, "", required=True),
                  a("do_rotary", at.INT, "", required=False), a("rotary_interleaved", at.INT, "", required=False),
                  a("local_window_size", at.INT, "", required=False), a("scale", at.FLOAT, "", required=False),
                  a("causal", at.INT, "", required=False), a("sliding_window_cache", at.INT, "", required=False)]
    onnx.defs.register_schema(OpSchema(
        "GroupQueryAttention", DOMAIN, 1, inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""),
                          ("P", ["tensor(int64)"], "")]))


_register()
_msft = onnxscript.values.Opset(DOMAIN, 1)


def _group_query_attention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, heads: int,
                           kv_heads: int, window: int = 0, scale: float = 0.0, spans=None, capacity: int = 0):
    """window > 0 (with capacity): a sliding window of that many keys, the query's own included (local_window_size = window: ORT
    1.32's CPU kernel attends slots q - window < k <= q, measured against transformers' sliding mask by
    tests/test_gemma4_decoder.py; the schema's "left window" reads one less); scale 0: the op's default 1/sqrt(head_dim);
    capacity > 0: the buffers are a windowed cache of that many rows (sliding_window_cache 1); with spans too, two
    nodes (_windowed_spans)."""
    extra = {}
    if window > 0 or spans is not None:
        if not capacity or window <= 0:
            raise ValueError("a sliding window (and spans) take a windowed cache: capacity > 0 "
                             "(export/graphs.py window_capacity)")
        if spans is not None:
            return _windowed_spans(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, heads, kv_heads,
                                   window, scale, spans, capacity)
        extra.update(local_window_size=window, sliding_window_cache=1)
    if scale:
        extra["scale"] = float(scale)
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids,
                                     num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0, **extra)


def _windowed_spans(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, heads: int, kv_heads: int,
                    window: int, scale: float, spans, capacity: int):
    """A windowed cache with spans: ORT takes sliding_window_cache with a causal window only (causal 0 needs
    local_window_size -1, sliding_window_cache a window), so two nodes. The first (causal, windowed) writes the
    present buffers (its output unused); the second (causal 0, the span bias, no window attribute) gives the output,
    reading the buffers before the step, padded by s rows, as a cache by slot in the frame of their row 0: the step's
    slots are L(p) .. L(p) + s - 1 there (p = seqlens_k + 1 - s, L the resident rows: format/manifest.py `resident`),
    its present ([B, kv_heads, capacity + s, d]) unused. The bias is built from
    those frame slots (the window and the span test are differences of slots; the rotary is at position_ids)."""
    common = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)
    if scale:
        common["scale"] = float(scale)
    _, present_k, present_v = _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin,
                                                        position_ids, local_window_size=window,
                                                        sliding_window_cache=1, **common)
    i32 = onnx.TensorProto.INT32
    one = op.Cast(op.Constant(value_int=1), to=i32)
    c = op.Cast(op.Constant(value_int=capacity), to=i32)
    g = op.Cast(op.Constant(value_int=capacity - window + 1), to=i32)
    s = op.Cast(op.Shape(q, start=1, end=2), to=i32)  # [1]
    p = op.Sub(op.Add(seqlens_k, one), s)  # [B] the slots before the step
    evicted = op.Mul(op.Div(op.Add(op.Sub(p, c), op.Sub(g, one)), g), g)  # G * ceil((p - C) / G)
    resident = op.Where(op.Greater(p, c), op.Sub(p, evicted), p)  # [B] L(p)
    frame_k = op.Sub(op.Add(resident, s), one)  # [B] the frame's seqlens_k
    frame_total = op.Add(op.ReduceMax(frame_k, keepdims=0), one)
    bias = _span_bias(q, frame_k, frame_total, spans, window)
    # (s zero rows after the buffers: a cache by slot must hold the frame's total, L(p) + s <= capacity + s)
    pads = op.Concat(op.Constant(value_ints=[0] * 6), op.Shape(q, start=1, end=2), op.Constant(value_ints=[0]), axis=0)
    out, _, _ = _msft.GroupQueryAttention(q, k, v, op.Pad(past_k, pads), op.Pad(past_v, pads), frame_k, frame_total,
                                          cos, sin, position_ids, bias, causal=0, **common)
    return out, present_k, present_v


def _span_bias(q, seqlens_k, total, spans, window: int):
    """attention_bias [B, 1, s, total] (module doc): q [B, s, ·] (s: the rows of each sequence), seqlens_k [B] int32
    (each step's last slot), total [] int32, spans [B·s] int64."""
    i64 = onnx.TensorProto.INT64
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    s = op.Shape(q, start=1, end=2)  # [1]
    s0 = op.Squeeze(s, op.Constant(value_ints=[0]))
    keys = op.Range(zero, op.Cast(total, to=i64), one)  # [T] slots
    first = op.Sub(op.Add(op.Cast(seqlens_k, to=i64), one), s0)  # [B] each step's first slot
    # (Reshape, not Unsqueeze on axis 0: batch_dim.add_batch_dim takes an Unsqueeze(0) into an Add for hidden rows)
    row_vector = op.Constant(value_ints=[1, -1])
    slots = op.Unsqueeze(op.Add(op.Unsqueeze(first, op.Constant(value_ints=[1])),
                                op.Reshape(op.Range(zero, s0, one), row_vector)),
                         op.Constant(value_ints=[2]))  # [B, s, 1] the queries' slots
    keys3 = op.Reshape(keys, op.Constant(value_ints=[1, 1, -1]))  # [1, 1, T]
    sp = op.Reshape(spans, op.Concat(op.Constant(value_ints=[-1]), s, axis=0))  # [B, s]
    row = op.Sub(op.Reshape(keys, row_vector), op.Unsqueeze(first, op.Constant(value_ints=[1])))
    key_span = op.Where(op.GreaterOrEqual(row, zero),
                        op.GatherElements(sp, op.Max(op.Min(row, op.Sub(s0, one)), zero), axis=1),
                        op.Constant(value_int=-1))  # [B, T] each key's span (-1: before the step or none)
    qs = op.Unsqueeze(sp, op.Constant(value_ints=[2]))  # [B, s, 1]
    same = op.And(op.Equal(qs, op.Unsqueeze(key_span, op.Constant(value_ints=[1]))), op.GreaterOrEqual(qs, zero))
    seen = op.Or(op.LessOrEqual(keys3, slots), same)
    if window > 0:
        seen = op.And(seen, op.Greater(keys3, op.Sub(slots, op.Constant(value_int=window))))
    bias = op.Where(seen, op.Constant(value_float=0.0), op.Constant(value_float=-3.0e38))
    return op.CastLike(op.Unsqueeze(bias, op.Constant(value_ints=[1])), q)


TABLE = {torch.ops.vlmrt.group_query_attention.default: _group_query_attention}


def pack_qkv(model: onnx.ModelProto) -> int:
    """Each GroupQueryAttention whose query, key and value are, in that order, the three outputs of one Split used
    nowhere else (quantize.fuse_shared_input_matmuls' q/k/v MatMul + Split) takes the Split's input as its packed
    query [1, ar, (heads + 2 kv_heads) * d], key and value left out: the op splits it itself, the same values, one
    node less per layer. Projections with a bias or a norm between (Qwen2, Qwen3) keep their Split. Returns how many
    were packed."""
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    uses: dict[str, int] = {o.name: 1 for o in g.output}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    drop, sizes = set(), set()
    for n in g.node:
        if n.op_type != "GroupQueryAttention" or n.domain != DOMAIN:
            continue
        split = producers.get(n.input[0])
        if (split is None or split.op_type != "Split" or list(split.output) != list(n.input[:3])
                or any(uses[o] != 1 for o in split.output)):
            continue
        n.input[0], n.input[1], n.input[2] = split.input[0], "", ""
        drop.add(split.name)
        sizes.update(i for i in split.input[1:] if uses.get(i) == 1)  # its split sizes, used by it alone
    if drop:
        keep = [n for n in g.node if n.name not in drop]
        del g.node[:]
        g.node.extend(keep)
        inits = [i for i in g.initializer if i.name not in sizes]
        del g.initializer[:]
        g.initializer.extend(inits)
    return len(drop)
