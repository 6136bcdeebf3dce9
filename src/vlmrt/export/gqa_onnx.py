"""torch.ops.vlmrt.group_query_attention (families/gqa.py) -> one com.microsoft GroupQueryAttention node.

ORT's contrib ops have no schema in `onnx`, and the dynamo exporter builds a node only from a schema: this module
registers the op's schema (the inputs vlmrt uses, in ORT's order: docs/ContribOperators.md of onnxruntime) once, and
gives the exporter the translation (`TABLE`, torch.onnx.export's custom_translation_table). do_rotary with the cos /
sin caches applies RoPE (rotary_interleaved 0: transformers' rotate-half form); scale 1/sqrt(head_dim), ORT's default.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

from ..families import gqa  # noqa: F401  (registers the torch op)

DOMAIN = "com.microsoft"


def _register() -> None:
    if onnx.defs.has("GroupQueryAttention", DOMAIN):
        return
    p, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [p("query", "T"), p("key", "T", param_option=opt), p("value", "T", param_option=opt),
              p("past_key", "T", param_option=opt), p("past_value", "T", param_option=opt), p("seqlens_k", "M"),
              p("total_sequence_length", "M"), p("cos_cache", "T", param_option=opt),
              p("sin_cache", "T", param_option=opt)]
    outputs = [p("output", "T"), p("present_key", "T"), p("present_value", "T")]
    a, at = OpSchema.Attribute, OpSchema.AttrType
    attributes = [a("num_heads", at.INT, "", required=True), a("kv_num_heads", at.INT, "", required=True),
                  a("do_rotary", at.INT, "", required=False), a("rotary_interleaved", at.INT, "", required=False)]
    onnx.defs.register_schema(OpSchema(
        "GroupQueryAttention", DOMAIN, 1, inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")]))


_register()
_msft = onnxscript.values.Opset(DOMAIN, 1)


def _group_query_attention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, heads: int, kv_heads: int):
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, cos, sin, num_heads=heads,
                                     kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)


TABLE = {torch.ops.vlmrt.group_query_attention.default: _group_query_attention}
