"""The HTP target's lookahead verify graph (`vlmrt export --target htp --lookahead-ar K`): the decode graph at
AR = K, quantized so that each of its rows computes what a decode step computes.

A verify call runs the current token and up to K - 1 drafts (padded) at positions pos..pos+K-1 under the runtime's
mask and returns every row's logits and new K/V rows; the runtime keeps the rows of the accepted prefix only
(runtime/engine.py Engine.verify, as ExecuTorch's Qualcomm runner copies only its `selected` rows into the cache).
For the answer to be the plain decode's, a verify row must be a decode step: the graph gets the decode graph's
precision, weights and KV encoding (the cache it reads and writes is decode's), and every quantized tensor the
decode graph's (scale, zero point) (`copy_encodings`) -- static 16-bit encodings are per tensor, so a row's
arithmetic then does not depend on the other rows. It is quantized like any graph first (calibration feeds made from
decode's recordings, `TiledFeeds`), which places its Q/DQ nodes as decode's are placed; then decode's values replace
the calibrated ones node by node.
"""

from __future__ import annotations

import numpy as np
import onnx

from .. import manifest as mf
from ..runtime.kv_cache import attention_mask


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
    """Calibration feeds for the verify graph made from the decode graph's recorded ones (recorder: htp.Recorder):
    each decode call's token repeated over the K rows at positions pos..pos+K-1 under the causal mask. They only
    have to be valid inputs: every activation encoding is decode's (overrides)."""

    def __init__(self, recorder, dec: mf.DecoderSpec, ar: int, max_context: int):
        self.recorder, self.dec, self.ar, self.ctx = recorder, dec, ar, max_context

    def reader(self):
        d, ar = self.dec, self.ar
        rec = type(self.recorder)(None, self.recorder.kv_inputs, 0, self.recorder.positions)
        for f in self.recorder.feeds:
            pos = int(f[d.positions_input][0][0])
            g = dict(f)
            g[d.embeds_input] = (np.repeat(f[d.embeds_input][0], ar, axis=0), None)
            g[d.positions_input] = (pos + np.arange(ar, dtype=np.int64), None)
            g[d.mask_input] = (attention_mask(pos, ar, self.ctx, np.float32, neg=d.mask_value), None)
            rec.first.append(g)
        return rec.reader()
