"""RMSNorm as one op: ORT's SimplifiedLayerNormalization, for the CPU graphs and the HTP target.

The exporter writes RMSNorm (layers.RMSNorm, mirroring transformers' LlamaRMSNorm) as primitive ops:

    x -> Pow(2) -> ReduceMean(-1, keepdims) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x, .) -> Mul(weight, .)

and Gemma 4's (families/gemma4/language.py, transformers' Gemma4RMSNorm) with Pow(-0.5) for Sqrt -> Reciprocal. The
CHAINS a caller names are fused: the HTP target both, the CPU graphs the first only (Gemma 4's CPU graphs keep their
primitive ops, as their ids are tested against transformers).

:func:`fuse_rms_norm` replaces each chain with one ``SimplifiedLayerNormalization`` (domain "", ORT's
fused RMSNorm kernel, which the QNN EP maps to the HTP's RmsNorm). Why, per target:

* CPU/CUDA graphs (graphs.export_decoder): seven kernel launches per norm, and ORT's own
  SimplifiedLayerNormFusion does not match this chain (it expects Div, not Reciprocal + Mul). ORT does not fold
  the residual Add in front (its SkipLayerNorm fusion wants an Add used by the norm alone, and the residual
  stream goes on): SmolLM2-135M decode runs 61 Add + 61 SimplifiedLayerNormalization. Folding them by hand into
  SkipSimplifiedLayerNormalization was measured (docs/performance.md#packed-qkv-and-the-decode-steps-scalar-io).
* HTP: quantized statically, every edge of the chain gets its own 16-bit encoding, and x**2 of a real
  LLM's residual stream (values in the hundreds at the attention-sink positions) needs a range of ~1e5
  that a 16-bit grid cannot hold next to the small values of ordinary tokens: the QDQ decoder's top-1 agreement
  collapses. Fused, only the op's input and output are quantized (figures: docs/precisions.md).
  (ONNX opset 23's ``RMSNormalization`` is rejected by the QNN EP in onnxruntime-qnn 2.7.)

The contrib op has no schema in ``onnx``, so ORT's quantizer cannot run the version converter after
the fusion (it converts to opset 21 for 16-bit QDQ): :func:`prepare_for_qdq` sets opset 21 first.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .cpu.quantize import set_nodes

QDQ_OPSET = 21  # 16-bit QuantizeLinear/DequantizeLinear; ORT's quantizer converts to it anyway


def _const(inits: dict, name: str, producers: dict) -> np.ndarray | None:
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        return numpy_helper.to_array(node.attribute[0].t) if node.attribute[0].name == "value" else None
    return None


def _scalar(inits, name, producers) -> float | None:
    v = _const(inits, name, producers)
    return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None


CHAINS = {"sqrt_reciprocal": ("Sqrt", "Reciprocal"), "pow": ("Pow",)}  # mean + eps -> its reciprocal square root


def fuse_rms_norm(model: onnx.ModelProto, chains: tuple[str, ...] = ("sqrt_reciprocal",)) -> int:
    """Replace every RMSNorm chain (see module doc) of the CHAINS named in ``model`` by one
    SimplifiedLayerNormalization; returns how many. Chains whose intermediates are used elsewhere are left alone."""
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}

    def only(t, op):  # the single consumer of t, if it is an `op` node and t is not a graph output
        c = consumers.get(t, [])
        return c[0] if len(c) == 1 and c[0].op_type == op and t not in graph_outputs else None

    drop, new = [], {}  # new: id(first node to replace) -> its fused nodes
    for pow_ in g.node:
        if pow_.op_type != "Pow" or _scalar(inits, pow_.input[1], producers) != 2.0:
            continue
        x = pow_.input[0]
        mean = only(pow_.output[0], "ReduceMean")
        if mean is None:
            continue
        keep = next((helper.get_attribute_value(a) for a in mean.attribute if a.name == "keepdims"), 1)
        axes = _const(inits, mean.input[1], producers) if len(mean.input) > 1 else None
        if axes is None:
            axes = next((np.array(helper.get_attribute_value(a)) for a in mean.attribute if a.name == "axes"), None)
        if keep != 1 or axes is None or axes.reshape(-1).tolist() != [-1]:
            continue
        add = only(mean.output[0], "Add")
        if add is None:
            continue
        eps = _scalar(inits, add.input[1] if add.input[0] == mean.output[0] else add.input[0], producers)
        steps = _rsqrt_steps(add.output[0], chains, only, inits, producers)
        norm = only(steps[-1].output[0], "Mul") if steps else None
        if eps is None or norm is None or x not in norm.input:
            continue
        scales = consumers.get(norm.output[0], [])  # one weight, or several (Gemma 4's k_eq_v: k_norm and v_norm
        weights = []  # of the same rows share the normalized product in the exported graph)
        for scale in scales:
            if scale.op_type != "Mul":  # (a Cast of an fp16 graph, ...: not a weight)
                weights.append(None)
                continue
            other = scale.input[0] if scale.input[1] == norm.output[0] else scale.input[1]
            w = _const(inits, other, producers)
            weights.append(other if w is not None and w.ndim == 1 else None)
        if not scales or None in weights or norm.output[0] in graph_outputs:
            continue  # (no weight: a ones vector of the last dimension is not known here statically)
        drop += [pow_, mean, add, *steps, norm, *scales]
        new[id(pow_)] = [helper.make_node("SimplifiedLayerNormalization", [x, w_name], [scale.output[0]],
                                          name=f"{norm.name or norm.output[0]}_rmsnorm{'_' + str(k) if k else ''}",
                                          axis=-1, epsilon=eps, stash_type=1)
                         for k, (scale, w_name) in enumerate(zip(scales, weights))]
    if not new:
        return 0
    gone = {id(n) for n in drop}
    nodes = []
    for n in g.node:
        if id(n) in new:
            nodes += new[id(n)]
        elif id(n) not in gone:
            nodes.append(n)
    set_nodes(g, nodes)  # also drops the chains' 2.0 / eps constants
    return sum(len(fused) for fused in new.values())


def _rsqrt_steps(t: str, chains, only, inits, producers) -> list | None:
    """The nodes that take t (mean + eps) to its reciprocal square root, in one of the named CHAINS; None if none."""
    for name in chains:
        steps, at = [], t
        for op in CHAINS[name]:
            node = only(at, op)
            if node is None or (op == "Pow" and _scalar(inits, node.input[1], producers) != -0.5):
                break
            steps.append(node)
            at = node.output[0]
        else:
            return steps
    return None


def prepare_for_qdq(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The float graph as the HTP quantizer should see it: opset QDQ_OPSET, RMSNorm fused."""
    main = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if main.version < QDQ_OPSET:
        # 20 -> 21 only widened types (int4/uint4, block QDQ) of the ops it touched, but for
        # GroupNormalization; the exporter writes opset 20 and no GroupNormalization. Bumping the number
        # avoids onnx's version converter, which serializes the whole model (2 GB protobuf limit).
        if main.version != 20 or any(n.op_type == "GroupNormalization" for n in model.graph.node):
            raise ValueError(f"HTP quantization expects an opset-20 graph without GroupNormalization (got opset {main.version})")
        main.version = QDQ_OPSET
    return model, fuse_rms_norm(model, tuple(CHAINS))
