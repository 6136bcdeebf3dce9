"""Per-graph precisions of the HTP target (`vlmrt export --target htp --quant ...`), as QHexRT balances them.

    --quant w8a16                                         (the default) every graph a16w8 QDQ
    --quant w4a16 / w4a16o                                the decoder graphs 4-bit block-wise, vision at 8 bits
    --quant vision=fp16,prefill=fp16,decode=w4a16o,lm_head=w8a16   per graph (QHexRT's InternVL3.5-1B balance)
    --quant ...,head=w8a16                                the lm head as its own graph at that precision (htp_head.py)

The lm head as its own graph is also the default where QHexRT has it: an untied head (tie_word_embeddings false)
under a per-graph spec that names neither head= nor lm_head= gets head=w8a16. Its weight is then a separate large
weight that would otherwise be copied into both decoder binaries. `lm_head=PREC` keeps it inside the decoder graphs
(the one way to turn the default off); a plain precision (`--quant w8a16`, no --quant) keeps it inside too, at that
precision; so does --lookahead-ar (the verify graph needs every row's logits; the head graph maps one row).
A tied head (its weight is the embedding table) stays inside unless head= is named.

Precisions on the HTP:
  fp16    the HTP's float path: the float graph as exported, compiled by the QNN EP with provider option
          `enable_htp_fp16_precision=1` (and soc_model set: the EP refuses the option without it); only the
          KV cache I/O is quantized (uint8, a DequantizeLinear at each cache input and a QuantizeLinear at each
          new-rows output), so that the runtime's cache stays one uint8 buffer whatever graph writes it
  w8a16   16-bit activations, uint8 per-channel weights (QDQ, onnxruntime.quantization's QNN config)
  w4a16   16-bit activations, int4 block-wise symmetric weights (export/htp/int4_blocks.py), block 32
  w4a16o  as w4a16 with GGUF Q4_1's per-block offset carried exactly (int4_blocks.offsets_decompose)
`lm_head` (the decoder's last MatMul / Gemm) follows nothing 4-bit unless named: w8a16 under a 4-bit decoder
(its largest weight and every logit, as QHexRT keeps its lm head at W8A16); name `lm_head=w4a16` to get 4.
A fp16 decoder graph keeps a float lm head. The CPU EP runs an fp16 graph in float32 (the flag is the QNN EP's).
The host's embedding table stays the float bundle's float32 one: a float16 table (QHexRT's "embedding 311 MB" for
InternVL3.5-1B) rounds the rows more coarsely than a 16-bit QDQ input's grid (docs/npu-deploy.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import int4_blocks
from .. import onnx_names
from ..cpu import quantize

PRECISIONS = ("fp16", "w8a16", "w4a16", "w4a16o")
HEADS = ("w8a16", "w4a16", "w4a16o")
DEFAULT = "w8a16"
DEFAULT_OWN_HEAD = "w8a16"  # an untied head under a per-graph spec: its own graph (QHexRT's "lm-head W8A16")
# provider options a graph of that precision is compiled (and loaded) with; recorded per graph in the manifest
QNN_OPTIONS = {"fp16": {"enable_htp_fp16_precision": "1"}}
LABEL = {"fp16": "fp16", "w8a16": "qdq-a16w8", "w4a16": "qdq-a16w4", "w4a16o": "qdq-a16w4o"}
WEIGHTS = {"fp16": "float (fp16 on the HTP)", "w8a16": "uint8 per-channel",
           "w4a16": "int4 block-wise (32) symmetric", "w4a16o": "int4 block-wise (32) with Q4_1 block offsets"}


def parse(spec: str | None, untied: bool = False, lookahead: bool = False) -> dict[str, str]:
    """--quant for --target htp -> {vision, prefill, decode, lm_head} (lm_head: the decoder graphs' head), and
    head: the lm head as its own graph (export/htp/head.py) at that precision, when the spec names it, or
    DEFAULT_OWN_HEAD when the checkpoint's head is untied (untied), the spec is per graph and names neither
    head= nor lm_head=, and there is no lookahead verify graph (lookahead: it needs every row's logits)."""
    parts = [p for p in (spec or "").split(",") if p.strip()]
    own = [p.partition("=")[2].strip() for p in parts if p.partition("=")[0].strip() == "head"]
    rest = ",".join(p for p in parts if p.partition("=")[0].strip() != "head")
    if own and (len(own) > 1 or own[0] not in PRECISIONS):
        raise quantize.QuantError(f"--target htp: head={own[-1]} is not an HTP precision; choose one of "
                                  f"{', '.join(PRECISIONS)}")
    if own and "lm_head=" in rest.replace(" ", ""):
        raise quantize.QuantError("--target htp: head= (the lm head as its own graph) and lm_head= (its precision "
                                  "inside the decoder graphs) exclude each other")
    if own and rest and "=" not in rest:
        raise quantize.QuantError("--target htp: with head=, give the other graphs per graph too "
                                  "(e.g. prefill=w8a16,decode=w4a16o,head=w8a16)")
    if rest and "=" not in rest and rest.strip() not in PRECISIONS:  # (before parse gives it a vision precision)
        raise quantize.QuantError(f"--target htp: {rest.strip()} is not an HTP precision; choose one of "
                                  f"{', '.join(PRECISIONS)}")
    prec = quantize.parse(rest or None, default=DEFAULT)
    if "=" not in rest:  # a plain precision: the HTP's head rule below, not the CPU's (quantize.HEAD_OF_PLAIN: re-scored 4-bit)
        prec.pop("lm_head", None)
    if own:
        prec["head"] = own[0]
    for g, p in prec.items():
        if g == "lm_head" and p not in HEADS:
            raise quantize.QuantError(f"--target htp: lm_head={p} is not an HTP head precision; choose one of "
                                      f"{', '.join(HEADS)}")
        if p not in PRECISIONS:
            raise quantize.QuantError(f"--target htp: {g}={p} is not an HTP precision; choose one of {', '.join(PRECISIONS)}")
    if untied and not lookahead and "=" in rest and "lm_head" not in prec and "head" not in prec:
        prec["head"] = DEFAULT_OWN_HEAD
    if "lm_head" not in prec and "head" not in prec:
        prec["lm_head"] = "w8a16"
    return prec


def check_blocks(prec: dict[str, str], hidden: int, attention: int, intermediate: int) -> None:
    """4-bit decoder graphs need every weight's input size (hidden for q/k/v, gate/up and the head; heads x head_dim
    for o_proj; intermediate for down_proj) a multiple of int4_blocks.BLOCK: a shorter last block is not made int4
    (int4_blocks.requantize), so the bundle would be 8-bit where its manifest says 4."""
    sizes = {"hidden_size": hidden}
    if {prec.get("prefill"), prec.get("decode")} & {"w4a16", "w4a16o"}:
        sizes.update({"heads x head_dim": attention, "intermediate_size": intermediate})
    elif not {prec.get("lm_head"), prec.get("head")} & {"w4a16", "w4a16o"}:
        return
    bad = [f"{k} {v}" for k, v in sizes.items() if v % int4_blocks.BLOCK]
    if bad:
        raise quantize.QuantError(f"--target htp: 4-bit decoder weights are int4 blocks of {int4_blocks.BLOCK} inputs, "
                                  f"and this checkpoint's {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of "
                                  f"{int4_blocks.BLOCK}; "
                                  "use w8a16 for the decoder graphs")


SOFTCAP_OPS = ("Tanh", "Sigmoid", "Mul", "Div", "Add", "Sub")  # the final logit soft-capping, tanh(x / c)·c or its
# HTP form 2c·sigmoid(2x / c) − c (softcap_sigmoid.py): unary ops and ops with a scalar constant


def head_node(model: onnx.ModelProto, output: str) -> str:
    """Name of the MatMul / Gemm that produces graph output `output` (through casts, reshapes, a bias Add and the
    soft-capping's ops: SOFTCAP_OPS)."""
    g = model.graph
    by_out = {o: n for n in g.node for o in n.output}
    scalars = {i.name for i in g.initializer if int(np.prod(i.dims)) == 1}

    def source(node):  # the input that carries the logits (the other, if any, a constant)
        computed = [i for i in node.input if i not in scalars]
        return computed[0] if len(computed) == 1 else node.input[0]

    node = by_out.get(output)
    while node is not None and node.op_type in ("Cast", "Identity", "Add", "Reshape", "Squeeze", "Unsqueeze") + SOFTCAP_OPS:
        node = by_out.get(source(node) if node.op_type in SOFTCAP_OPS else node.input[0])
    if node is None or node.op_type not in ("MatMul", "Gemm") or not node.name:
        raise quantize.QuantError(f"cannot find the lm head MatMul / Gemm that produces {output!r}")
    return node.name


def float_kv_edges(model: onnx.ModelProto, encodings: dict[str, tuple[float, int]], outputs: dict[str, str]) -> None:
    """A float graph's KV cache I/O as uint8: input x -> DequantizeLinear(its encoding) -> ...; ... -> QuantizeLinear
    (the encoding of the input outputs names) -> output y. encodings: cache input -> (scale, zero point)."""
    g = model.graph
    for name, (scale, zp) in encodings.items():
        g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{name}_kv_scale"),
                              numpy_helper.from_array(np.array(zp, np.uint8), f"{name}_kv_zero_point")])
        deq = name + "_kv_dequantized"
        for n in g.node:
            for j, i in enumerate(n.input):
                if i == name:
                    n.input[j] = deq
        g.node.insert(0, helper.make_node("DequantizeLinear", [name, f"{name}_kv_scale", f"{name}_kv_zero_point"], [deq],
                                          name=name + "_kv_DequantizeLinear"))
        next(v for v in g.input if v.name == name).type.tensor_type.elem_type = onnx.TensorProto.UINT8
    for name, like in outputs.items():
        src = name + "_kv_float"
        onnx_names.rename_tensor(g, name, src)
        g.node.append(helper.make_node("QuantizeLinear", [src, f"{like}_kv_scale", f"{like}_kv_zero_point"], [name],
                                       name=name + "_kv_QuantizeLinear"))
        next(v for v in g.output if v.name == name).type.tensor_type.elem_type = onnx.TensorProto.UINT8
    del g.value_info[:]
