"""torch.ops.vlmrt.linear_attention (families/linear_attention.py) -> one com.microsoft LinearAttention node
(update_rule gated_delta, scale 1/sqrt(dk): ORT's default), its schema registered for the dynamo exporter as
export/gqa_onnx.py registers GroupQueryAttention's."""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

from ..families import linear_attention  # noqa: F401  (registers the torch op)

DOMAIN = "com.microsoft"


def _register() -> None:
    if onnx.defs.has("LinearAttention", DOMAIN):
        return
    p, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [p("query", "T"), p("key", "T"), p("value", "T"), p("past_state", "T", param_option=opt),
              p("decay", "T", param_option=opt), p("beta", "T", param_option=opt)]
    outputs = [p("output", "T"), p("present_state", "T")]
    a, at = OpSchema.Attribute, OpSchema.AttrType
    attributes = [a("q_num_heads", at.INT, "", required=True), a("kv_num_heads", at.INT, "", required=True),
                  a("update_rule", at.STRING, "", required=False)]
    onnx.defs.register_schema(OpSchema(
        "LinearAttention", DOMAIN, 1, inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")]))


_register()
_msft = onnxscript.values.Opset(DOMAIN, 1)


def _linear_attention(q, k, v, past, decay, beta, q_heads: int, heads: int):
    return _msft.LinearAttention(q, k, v, past, decay, beta, q_num_heads=q_heads, kv_num_heads=heads,
                                 update_rule="gated_delta")


TABLE = {torch.ops.vlmrt.linear_attention.default: _linear_attention}
