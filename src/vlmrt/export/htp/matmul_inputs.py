"""The second input of a MatMul of two activations (attention's q·kᵀ keys and probs·v values) quantized as int16,
symmetric, in the HTP graphs: the HTP computes that MatMul at full 16 bits only so.

With the target's default 16-bit activations (uint16, a zero point of its own) the QNN EP hands the HTP a dynamic
second input converted to symmetric uint16, which the HTP's MatMul reads at about 8 bits: on its x86-64 simulator
(onnxruntime-qnn, htp_arch 79) a [1, 32] × [32, 257] product of normal rows is 0.25-0.28 off the CPU EP's on a ±30
range (the CPU EP's QDQ graph: 0.022 off float); with the second input int16 symmetric it is 0.014 off
(tests/test_htp_matmul_inputs.py measures it on that graph). Gemma 4's scale-1 attention over RMS-normed q and k gives scores
of ±10 to ±29, where that error (1-3 % of a score, 0.1-0.6 absolute) made the softmax's rows 1-10 % off and the
simulator's greedy ids part from the CPU EP's within a few tokens (docs/gemma4.md, "On the HTP"). The other inputs
keep the default: a MatMul with a weight is 8-bit weights by design, and its 16-bit first input is read at 16 bits.
"""

from __future__ import annotations

import onnx


def activation_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMul nodes whose two inputs are both computed (neither a weight nor a Constant's output)."""
    g = model.graph
    consts = {i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    return [n for n in g.node if n.op_type == "MatMul" and not consts & set(n.input[:2])]


def second_input_overrides(model: onnx.ModelProto) -> dict:
    """onnxruntime.quantization tensor overrides: each activation MatMul's second input as symmetric int16 (the
    quantizer's QNN config inserts the conversions its producers and other readers need)."""
    from onnxruntime.quantization import QuantType

    return {n.input[1]: [{"quant_type": QuantType.QInt16, "symmetric": True}] for n in activation_matmuls(model)}
