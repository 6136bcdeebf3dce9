"""The HTP target's lookahead verify graph (`vlmrt export --target htp --lookahead-ar K`): the decode graph at
AR = K, quantized so that each of its rows computes what a decode step computes.

A verify call runs the current token and up to K - 1 drafts (padded) at positions pos..pos+K-1 under the runtime's
mask and returns every row's logits and new K/V rows; the runtime keeps the rows of the accepted prefix only
(runtime/decode/cache_row.py CacheRow.verify, as ExecuTorch's Qualcomm runner copies only its `selected` rows into the cache).
For the answer to be the plain decode's, a verify row must be a decode step: the graph gets the decode graph's
precision, weights and KV encoding (the cache it reads and writes is decode's), and every quantized tensor the
decode graph's (scale, zero point) (`copy_encodings`) -- static 16-bit encodings are per tensor, so a row's
arithmetic then does not depend on the other rows. It is quantized like any graph first (calibration feeds made from
decode's recordings, `TiledFeeds`), which places its Q/DQ nodes as decode's are placed; then decode's values replace
the calibrated ones node by node. In both graphs the attention reads the step's own new K/V rows as the cache stores
them (`attend_as_stored`: through the uint8 cache encoding), not at 16 bits: a verify row's view of its block's
earlier tokens is then what a decode step reads back from the cache for them (without it, rows 1.. of a verify call
were up to 0.08 of ~3.4 apart in logits from sequential decode steps, and answers parted at near-ties).
"""

from __future__ import annotations

import numpy as np
import onnx

from ...format import manifest as mf
from ...runtime.decode.kv_cache import attention_mask
from .calibrate import slot_of


QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def copy_encodings(decode_qdq: onnx.ModelProto, verify_qdq: onnx.ModelProto) -> int:
    """Give the verify QDQ graph (quantized from its own calibration, KV edges cut) the decode QDQ graph's
    quantization, node by node: both are the same nodes in the same order (ValueError if not), so the i-th
    QuantizeLinear / DequantizeLinear of one is the i-th of the other; each gets decode's scale and zero point, and a
    DequantizeLinear of a constant (weights, int32 biases, whose scale is the input's times the weight's) decode's
    constant. Returns how many Q/DQ nodes were given decode's values."""
    a, b = decode_qdq.graph.node, verify_qdq.graph.node
    if [n.op_type for n in a] != [n.op_type for n in b]:
        raise ValueError("the verify graph's nodes are not the decode graph's: cannot give it decode's encodings")
    src = {i.name: i for i in decode_qdq.graph.initializer}
    dst = {i.name: i for i in verify_qdq.graph.initializer}
    copied = 0
    for na, nb in zip(a, b):
        if na.op_type not in QDQ_OPS:
            continue
        for j, (x, y) in enumerate(zip(na.input, nb.input)):
            if j == 0 and (na.op_type == "QuantizeLinear" or x not in src):
                continue  # the tensor quantized / dequantized, not a constant
            if x not in src or y not in dst:
                raise ValueError(f"{nb.name}: input {y!r} is not a constant as decode's {x!r} is")
            dst[y].CopyFrom(src[x])
            dst[y].name = y
        copied += 1
    return copied


class TiledFeeds:
    """Calibration feeds for the verify graph made from the decode graph's recorded ones (recorder: htp_calibrate.Recorder):
    each decode call's token repeated over the K rows at slots slot..slot+K-1 (positions p..p+K-1) under the causal mask. They only
    have to be valid inputs: every activation encoding is decode's (overrides)."""

    def __init__(self, recorder, dec: mf.DecoderSpec, ar: int, max_context: int):
        self.recorder, self.dec, self.ar, self.ctx = recorder, dec, ar, max_context

    def reader(self):
        d, ar = self.dec, self.ar
        rec = type(self.recorder)(None, self.recorder.kv_inputs, 0, self.recorder.mask, layers=self.recorder.layers)
        for f in self.recorder.feeds:
            slot = slot_of(f[d.kind.mask_input][0])
            positions = f[d.positions.input][0]  # [rows, 1]
            g = dict(f)
            g[d.embeds_input] = (np.repeat(f[d.embeds_input][0], ar, axis=0), None)
            g[d.positions.input] = (positions + np.arange(ar, dtype=np.int64), None)
            g[d.kind.mask_input] = (attention_mask(slot, ar, self.ctx, np.float32, neg=d.kind.mask_value), None)
            rec.first.append(g)
        return rec.reader()


def attend_as_stored(model: onnx.ModelProto, outputs: list[str]) -> int:
    """Make a QDQ decoder graph attend to its step's own K/V rows as the cache stores them: each new-rows output
    (uint8, the cache encoding) is dequantized, reshaped back and re-encoded as the graph reads the cache (the
    16-bit encoding of the past side of the Concat it feeds), and the Concat takes that instead of the 16-bit rows.
    A verify row then sees its block's earlier tokens exactly as a decode step reads them from the cache, and the
    decode graph (given the same change) its own token as later steps will. Returns the Concats changed."""
    from onnx import helper, numpy_helper, shape_inference

    g = model.graph
    inferred = shape_inference.infer_shapes(model).graph
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*inferred.value_info, *g.output]}
    prod = {o: n for n in g.node for o in n.output}
    changed = 0
    for out in outputs:
        q = prod[out]  # QuantizeLinear(cache encoding) -> out
        t = q.input[0]
        while prod[t].op_type in ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"):
            t = prod[t].input[0]
        q16 = prod[prod[prod[t].input[0]].input[0]].input[0]  # DQ <- Q (convert) <- DQ <- the rows' 16-bit Q
        hits = [(n, j) for n in g.node if n.op_type == "Concat" for j, i in enumerate(n.input)
                if i in prod and prod[i].op_type == "DequantizeLinear" and prod[i].input[0] == q16]
        if len(hits) != 1:
            raise ValueError(f"{out}: expected one Concat of the new rows with the cache, found {len(hits)}")
        concat, j = hits[0]
        past = prod[concat.input[1 - j]]  # the cache side: DequantizeLinear(its 16-bit encoding)
        shape = shapes.get(concat.input[j]) or _rows_like(shapes.get(concat.input[1 - j]), concat, shapes.get(out))
        if past.op_type != "DequantizeLinear" or not shape or 0 in shape:
            raise ValueError(f"{out}: the cache side of {concat.name} is not a DequantizeLinear of known shape")
        r = [f"{out}_as_stored_{k}" for k in range(4)]
        g.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), f"{out}_as_stored_shape"))
        new = [helper.make_node("DequantizeLinear", [out, q.input[1], q.input[2]], [r[0]], name=r[0]),
               helper.make_node("Reshape", [r[0], f"{out}_as_stored_shape"], [r[1]], name=r[1]),
               helper.make_node("QuantizeLinear", [r[1], past.input[1], past.input[2]], [r[2]], name=r[2]),
               helper.make_node("DequantizeLinear", [r[2], past.input[1], past.input[2]], [r[3]], name=r[3])]
        concat.input[j] = r[3]
        g.node.extend(new)
        changed += 1
    _toposort(g)
    return changed


def _rows_like(past: list[int] | None, concat, rows: list[int] | None) -> list[int] | None:
    """The new rows' shape at the Concat where ONNX shape inference lost it (past an ORT contrib op: Qwen3's q/k norms
    fused into SimplifiedLayerNormalization): the cache side's shape with the concat axis holding the rows of the
    [ar, kv_dim] output."""
    if not past or 0 in past or not rows or 0 in rows:
        return None
    axis = next((a.i for a in concat.attribute if a.name == "axis"), 0) % len(past)
    other = int(np.prod([d for k, d in enumerate(past) if k != axis]))
    if int(np.prod(rows)) % other:
        return None
    return [int(np.prod(rows)) // other if k == axis else d for k, d in enumerate(past)]


def _toposort(g) -> None:
    """Reorder g's nodes so that every node comes after the producers of its inputs (stable otherwise)."""
    ready = {i.name for i in g.input} | {i.name for i in g.initializer} | {""}
    pending, done = list(g.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in ready for i in n.input):
                done.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError("the graph has a cycle")
        pending = rest
    nodes = [onnx.NodeProto() for _ in done]
    for a, b in zip(nodes, done):
        a.CopyFrom(b)
    del g.node[:]
    g.node.extend(nodes)
