"""Weight precisions per graph, and weight-only quantization (MatMulNBits) for the CPU/CUDA EPs.

    --quant w4a16                                     every graph (4-bit precisions: the vision graph at 8 bits)
    --quant vision=fp16,prefill=fp16,decode=w4a16,lm_head=w8a16   per graph (QHexRT's InternVL3.5 balance)

Precisions:
  fp32   float32 weights and compute
  fp16   float16 weights and compute; the graph's I/O stays in the bundle's I/O dtype (casts at the edges)
  w8a16  int8 weights, block-wise symmetric (block 32), dequantized inside MatMulNBits; activations stay
  w4a16  int4 weights, block-wise symmetric (block 32)  float (fp32 on the CPU EP, fp16 on CUDA with --dtype fp16)
  w8a8   int8 weights as w8a16, computed in int8 with activations quantized per block at run time (CPU-fast);
         the vision graph's: int8 GEMMs (ORT dynamic quantization: per-channel weights, one activation scale per
         tensor; int8_matmuls), which its 1,000-row tiles run 2x faster than fp32
  w4a8   int4 weights as w4a16, computed in int8 likewise (what llama.cpp's Q4 x Q8 dot products do)
  w4a16o / w4a8o  int4 weights with a float offset per block (GGUF Q4_1's rule: w = d·q + m, min/max per block),
         on the same symmetric kernels plus the offsets' term (export/cpu/offsets.py); float / int8 compute
  w4a16og / w4a8og  the same grid and graph, the 4-bit values chosen by GPTQ on calibration Hessians of the decoder
         (as w4a8g's): lossless on Q4_1-sourced weights as w4a8o, closer to float on float-trained ones
  w4a16g / w4a8g  int4 weights with uint8 zero points (MatMulNBits' asymmetric form, as fast as the symmetric
         kernel), chosen by GPTQ on calibration Hessians of the decoder (export/cpu/gptq.py,
         export/cpu/calibrate_gptq.py); float / int8 compute
  w4a16r / w4a8r  (lm head only) the head at 4 bits (as w4a16 / w4a8) with its top 8 logits re-scored from per-row
         int8 weights in float (export/cpu/rescored_head.py): the 8-bit head's greedy choice at the 4-bit head's speed
  w4a16m / w4a8m  the Q4_K_M-style mix: w4a16 / w4a8, but every decoder layer's v_proj and down_proj as w8a8
         (8-bit weights, int8 compute: ORT's CPU kernel for 8-bit weights with float activations is its slow
         path). Sizes, speeds and accuracy of every precision: docs/precisions.md.

`lm_head` is the decoder's last MatMul (in both prefill and decode); it follows its graph unless named.
Weight-only quantization uses onnxruntime.quantization.matmul_nbits_quantizer (the well-kept
implementation ORT GenAI uses) after turning the exporter's Gemm(transB=1) nodes into MatMul.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from . import file_weights, gptq as quantize_gptq, head_blocks, offsets as quantize_offsets, rescored_head

PRECISIONS = ("fp32", "fp16", "w8a16", "w4a16", "w8a8", "w4a8", "w4a16m", "w4a8m", "w4a16o", "w4a8o", "w4a16og",
              "w4a8og", "w4a16g", "w4a8g", "w4a16r", "w4a8r")
GRAPHS = ("vision", "prefill", "decode", "lm_head")
WEIGHT_ONLY_BITS = {"w8a16": 8, "w4a16": 4, "w8a8": 8, "w4a8": 4, "w4a16m": 4, "w4a8m": 4, "w4a16o": 4, "w4a8o": 4,
                    "w4a16og": 4, "w4a8og": 4, "w4a16g": 4, "w4a8g": 4, "w4a16r": 4, "w4a8r": 4}
# MatMulNBits accuracy_level: None keeps float activations (a16 = "not 8-bit": fp32 on the CPU EP). ORT 1.32's
# CPU kernel for 8-bit weights is only fast with int8 compute (level 4: activations quantized per block at run
# time): that is w8a8, and for 4-bit weights w4a8 (measured: docs/precisions.md).
ACCURACY_LEVEL = {"w8a16": None, "w4a16": None, "w8a8": 4, "w4a8": 4, "w4a16m": None, "w4a8m": 4, "w4a16o": None,
                  "w4a8o": 4, "w4a16og": None, "w4a8og": 4, "w4a16g": None, "w4a8g": 4, "w4a16r": None, "w4a8r": 4}
# The block-offset precisions (asymmetric, float offset: export/cpu/offsets.py); the others but GPTQ are symmetric.
OFFSETS = ("w4a16o", "w4a8o", "w4a16og", "w4a8og")
# GPTQ (export/cpu/gptq.py), with integer zero points or (the og ones) on the block-offset grid: the decoder only
# (its calibration runs the decoder).
GPTQ = ("w4a16g", "w4a8g", "w4a16og", "w4a8og")
# The lm head at 4 bits with its top candidates re-scored from 8-bit rows (export/cpu/rescored_head.py): lm_head only.
RESCORED = ("w4a16r", "w4a8r")
BLOCK_SIZE = 32
# A plain 4-bit --quant keeps the vision graph at 8 bits (name `vision=w4a16` to get 4): the tower is a small
# part of the bundle and sees every image token, and int4 RTN there cost the easy-VQA demo model most of its
# lost points (docs/precisions.md). The int8-compute precisions give it w8a8, which for the vision graph is the
# int8 GEMM (int8_matmuls: 2x faster than fp32 on a tile). The float-activation ones keep w8a16: with w4a16m's
# decoder the int8 tower scored 252/260 on easy-VQA vs 253 (docs/performance.md#vision-encode); name `vision=w8a8`
# for the fast tower.
VISION_OF_PLAIN = {"w4a16": "w8a16", "w4a8": "w8a8", "w4a16m": "w8a16", "w4a8m": "w8a8", "w4a16o": "w8a16",
                   "w4a8o": "w8a8", "w4a16og": "w8a16", "w4a8og": "w8a8", "w4a16g": "w8a16", "w4a8g": "w8a8"}
# ... and the lm head of a plain block-offset spec at 4 bits with its top candidates re-scored from 8-bit rows
# (rescored_head.py): at plain 4 bits it cost the real decoder 0.14 of top-1, at 8 bits ~10 % of the decode step
# (SmolLM2's tied embedding is not Q4_1; docs/precisions.md). Name `lm_head=w8a8` for the 8-bit head.
HEAD_OF_PLAIN = {"w4a16o": "w4a16r", "w4a8o": "w4a8r", "w4a16og": "w4a16r", "w4a8og": "w4a8r"}
# The mixed 4-bit precisions: which decoder MatMuls get 8 bits (matched on the weight's name, which the exporter
# keeps from the HF module path: `...layers.N.self_attn.v_proj.weight_kn`), and the 8-bit precision they get.
# llama.cpp's Q4_K_M raises the same two (attn_v, ffn_down), in about half of the layers; all layers measured better,
# and the 8-bit part as w8a8 as accurate as w8a16 and faster (docs/precisions.md).
MIXED_8BIT = (".self_attn.v_proj.", ".mlp.down_proj.")
MIX_OF = {"w4a16m": "w8a8", "w4a8m": "w8a8"}


# Bodies whose MatMuls MatMulNBitsQuantizer quantizes as they are (symmetric, one precision): quantize_decoder reads
# their weights from the data file one at a time (file_weights.py).
PLAIN_BODY = tuple(p for p in WEIGHT_ONLY_BITS if p not in (*OFFSETS, *GPTQ, *RESCORED, *MIX_OF))


class QuantError(ValueError):
    pass


def parse(spec: str | None, default: str = "fp32") -> dict[str, str]:
    """'w4a16' or 'vision=fp16,decode=w4a16,...' -> {graph: precision} for vision/prefill/decode/lm_head."""
    if not spec:
        spec = default
    out: dict[str, str] = {}
    if "=" not in spec:
        if spec not in PRECISIONS:
            raise QuantError(f"unknown precision {spec!r}; choose one of {', '.join(PRECISIONS)}")
        if spec in RESCORED:
            raise QuantError(f"{spec}: the re-scored 4-bit precisions are for the lm head only (lm_head={spec})")
        out = {g: spec for g in GRAPHS if g != "lm_head"}
        out["vision"] = VISION_OF_PLAIN.get(spec, spec)
        if spec in HEAD_OF_PLAIN:
            out["lm_head"] = HEAD_OF_PLAIN[spec]
    else:
        for part in spec.split(","):
            name, _, prec = part.partition("=")
            name, prec = name.strip(), prec.strip()
            if name not in GRAPHS:
                raise QuantError(f"unknown graph {name!r} in --quant; graphs: {', '.join(GRAPHS)}")
            if prec not in PRECISIONS:
                raise QuantError(f"unknown precision {prec!r} for {name}; choose one of {', '.join(PRECISIONS)}")
            out[name] = prec
        bad = [g for g in ("vision", "prefill", "decode") if out.get(g) in RESCORED]
        if bad:
            raise QuantError(f"{bad[0]}={out[bad[0]]}: the re-scored 4-bit precisions are for the lm head only "
                             f"(lm_head={out[bad[0]]})")
        if out.get("vision") in GPTQ:
            raise QuantError(f"vision={out['vision']}: GPTQ is calibrated on the decoder only; give the vision graph "
                             "another precision (w8a8, w4a8, ...)")
        for g in ("vision", "prefill", "decode"):
            out.setdefault(g, default)
    return out


def gemm_to_matmul(model: onnx.ModelProto, keep: set[str] = frozenset(),
                   weights: file_weights.FileWeights | None = None, data: Path | None = None) -> onnx.ModelProto:
    """Gemm(x, W, b; transB=1) with constant W -> MatMul(x, Wᵀ) [+ Add(b)], which MatMulNBits can take; the nodes
    named in keep stay. weights: a W left in the data file gets a stand-in for Wᵀ (file_weights.py), read later.
    data: the model's weights stay in their external data files (read next to data, one weight at a time) and each
    Wᵀ is appended to the file data, not kept in the graph (export memory: a 2B tower's weights are 1.2 GB in fp32;
    in the graph they were read whole, then held twice)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    base = str(data.parent) if data is not None else ""
    out_data = open(data, "ab") if data is not None else None
    nodes = []
    for node in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.name in keep or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        name_t = node.input[1] + "_kn"
        if weights is not None and node.input[1] in weights:
            init = inits[node.input[1]]
            g.initializer.append(weights.transposed(node.input[1], name_t, init) if attrs.get("transB", 0) else
                                 weights.placeholder(name_t, init.dims, init.data_type, weights.readers[init.name]))
        else:
            w = numpy_helper.to_array(inits[node.input[1]], base)
            if attrs.get("transB", 0):
                w = np.ascontiguousarray(w.T)
            t = numpy_helper.from_array(w, name_t)
            if out_data is not None:
                _to_file(t, out_data, data.name)
            g.initializer.append(t)
        out = node.output[0]
        if len(node.input) > 2 and node.input[2]:
            mm = node.name + "_matmul_out"
            nodes.append(helper.make_node("MatMul", [node.input[0], name_t], [mm], name=node.name + "_matmul"))
            nodes.append(helper.make_node("Add", [mm, node.input[2]], [out], name=node.name + "_bias"))
        else:
            nodes.append(helper.make_node("MatMul", [node.input[0], name_t], [out], name=node.name or out + "_matmul"))
    if out_data is not None:
        out_data.close()
    set_nodes(g, nodes)
    return model


def _to_file(t: onnx.TensorProto, f, location: str) -> None:
    """Move t's raw data to the end of the open file f (named location, next to the graph) as external data."""
    pad = (-f.tell()) % 64
    f.write(b"\0" * pad)
    offset = f.tell()
    f.write(t.raw_data)
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(f.tell() - offset))):
        t.external_data.add(key=k, value=v)


def set_nodes(g: onnx.GraphProto, nodes: list) -> None:
    """Replace g's nodes and drop the initializers no node reads any more."""
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def producer_matmul(model: onnx.ModelProto, output: str) -> str | None:
    """Name of the MatMul that produces graph output `output` (the lm head for 'logits'), through casts, a bias and a
    logit soft-capping (Gemma 4: Div, Tanh, Mul by constants after the head)."""
    by_out = {o: n for n in model.graph.node for o in n.output}
    node = by_out.get(output)
    while node is not None and node.op_type in ("Cast", "Identity", "Add", "Div", "Tanh", "Mul"):
        node = by_out.get(node.input[0])
    return node.name if node is not None and node.op_type == "MatMul" else None


def weight_only(model: onnx.ModelProto, bits: int, *, include: list[str] | None = None,
                exclude: list[str] | None = None, accuracy_level: int | None = None) -> onnx.ModelProto:
    """MatMulNBits for constant-weight MatMuls (all, or only `include`, minus `exclude`)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    exclude = list(exclude or [])
    if include is not None:  # the quantizer's own nodes_to_include does not restrict (ORT 1.32): exclude the rest
        exclude += [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in include]
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=accuracy_level,
                             nodes_to_exclude=exclude)
    q.process()
    return q.model.model


def quantize_decoder(model: onnx.ModelProto, body: str, head: str, logits: str, hessian=None,
                     folder: Path | None = None) -> onnx.ModelProto:
    """Weight-only quantization of a decoder graph exported in float: body and lm head precisions. hessian(weight
    name) -> H [K, K] of that MatMul's input (calibrate_gptq.Hessians.for_weight): needed by the GPTQ precisions.
    folder: the model was read without its external data (onnx.load(..., load_external_data=False)), which is in
    folder; a plain weight-only head is then quantized from its data file a block of rows at a time
    (head_blocks.py: the same tensors, never whole in memory); with a plain weight-only body (PLAIN_BODY) its MatMul
    weights stay there too, each read when it is quantized (file_weights.py: the same graph, one float weight in
    memory at a time), else the other tensors are read first."""
    if (body in GPTQ or head in GPTQ) and hessian is None:
        raise QuantError(f"--quant {body if body in GPTQ else head}: GPTQ needs the decoder's calibration Hessians")
    if body not in WEIGHT_ONLY_BITS and head not in WEIGHT_ONLY_BITS:
        if folder is not None:
            external_data_helper.load_external_data_for_model(model, str(folder))
        return model
    streamed, weights = None, None
    if folder is not None:
        plain = head in WEIGHT_ONLY_BITS and head not in (*OFFSETS, *GPTQ, *RESCORED)
        node = head_blocks.head_node(model, logits) if plain else None
        if node is not None and body in PLAIN_BODY:
            weights = file_weights.FileWeights(folder)
            weights.defer(model, skip={node.input[1]})
        for init in model.graph.initializer:  # every external tensor but the head's weight (and the deferred)
            if external_data_helper.uses_external_data(init) and (node is None or init.name != node.input[1]) \
                    and (weights is None or init.name not in weights):
                external_data_helper.load_external_data_for_tensor(init, str(folder))
                init.data_location = onnx.TensorProto.DEFAULT
                del init.external_data[:]
        model = gemm_to_matmul(model, keep={node.name} if node is not None else set(), weights=weights)
        if node is not None:
            streamed = head_blocks.quantize_head(model, node, folder, WEIGHT_ONLY_BITS[head], BLOCK_SIZE,
                                                 ACCURACY_LEVEL[head])
        if weights is None:
            external_data_helper.load_external_data_for_model(model, str(folder))  # (anything else still external)
    else:
        model = gemm_to_matmul(model)
    lm = streamed or producer_matmul(model, logits)
    if lm is None:
        raise QuantError("cannot find the lm head MatMul in the decoder graph")
    others = {n.name for n in model.graph.node if n.op_type == "MatMul"} - {lm}
    if streamed:
        pass  # (the head is quantized)
    elif head in OFFSETS:
        set_nodes(model.graph, quantize_offsets.offset_nodes(model, ACCURACY_LEVEL[head], exclude=others,
                                                             hessian=hessian if head in GPTQ else None))
    elif head in GPTQ:
        set_nodes(model.graph, quantize_gptq.gptq_nodes(model, hessian, ACCURACY_LEVEL[head], exclude=others))
    elif head in RESCORED:
        node = next(n for n in model.graph.node if n.name == lm)
        w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == node.input[1]))
        model = weight_only(model, WEIGHT_ONLY_BITS[head], include=[lm], accuracy_level=ACCURACY_LEVEL[head])
        rescored_head.rescore(model, logits, *int8_rows(np.ascontiguousarray(w.T)))
    elif head in WEIGHT_ONLY_BITS:
        model = weight_only(model, WEIGHT_ONLY_BITS[head], include=[lm], accuracy_level=ACCURACY_LEVEL[head])
    wide = mixed_8bit_matmuls(model) if body in MIX_OF else []
    if body in MIX_OF and not wide:
        raise QuantError(f"--quant {body}: no v_proj/down_proj MatMul found in the decoder graph")
    if body in WEIGHT_ONLY_BITS:
        fuse_shared_input_matmuls(model, keep_apart={lm, *wide}, weights=weights)
    if weights is not None:  # (a plain body: MatMulNBitsQuantizer's pass below, one weight read at a time)
        done = file_weights.all_2d(model, {lm})
        if done:
            file_weights.quantize_matmuls(model, weights, WEIGHT_ONLY_BITS[body], BLOCK_SIZE, ACCURACY_LEVEL[body],
                                          exclude={lm})
        weights.load_rest(model)  # (anything not quantized: read now, as the in-memory passes had it)
        if done:
            return model
    if wide:
        model = weight_only(model, 8, include=wide, accuracy_level=ACCURACY_LEVEL[MIX_OF[body]])
    if body in OFFSETS:  # the lm head is no MatMul any more when quantized; exclude it when it stays float
        set_nodes(model.graph, quantize_offsets.offset_nodes(model, ACCURACY_LEVEL[body], exclude={lm},
                                                             hessian=hessian if body in GPTQ else None))
    elif body in GPTQ:
        set_nodes(model.graph, quantize_gptq.gptq_nodes(model, hessian, ACCURACY_LEVEL[body], exclude={lm}))
    elif body in WEIGHT_ONLY_BITS:  # the 4-bit pass takes the MatMuls still float (MatMulNBits nodes are not MatMuls)
        model = weight_only(model, WEIGHT_ONLY_BITS[body], exclude=[lm], accuracy_level=ACCURACY_LEVEL[body])
    return model


def fuse_shared_input_matmuls(model: onnx.ModelProto, keep_apart: set[str],
                              weights: file_weights.FileWeights | None = None) -> int:
    """MatMuls that read the same input with constant weights [K, N_i] (q/k/v, gate/up) -> one MatMul over the
    weights concatenated along N, then a Split into the original outputs. Weight-only quantization is per
    output column (blocks run along K), so the fused MatMulNBits computes every column as the separate ones
    did; what changes is one kernel call instead of 2-3 (an M=1 decode call is mostly dispatch and thread
    wake-up on 2 cores). Nodes named in keep_apart (the lm head, a mixed precision's 8-bit ones) stay.
    weights: the fused weight of members left in the data file is a stand-in (file_weights.py), read later.
    Returns the number of fused groups."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    groups: dict[str, list] = {}
    for n in g.node:
        if (n.op_type == "MatMul" and n.name not in keep_apart and n.input[1] in inits
                and len(inits[n.input[1]].dims) == 2):
            groups.setdefault(n.input[0], []).append(n)
    fused: dict[str, list] = {}  # name of a group's first node -> [MatMul, Split]
    drop = set()
    for x, members in groups.items():
        ws = [inits[m.input[1]] for m in members]
        if len(members) < 2 or len({(w.dims[0], w.data_type) for w in ws}) != 1 or not all(m.name for m in members):
            continue
        name = members[0].name + "_fused"
        fused_name = "+".join(m.input[1] for m in members)
        if weights is not None and any(w.name in weights for w in ws):
            w = weights.concatenated(ws, fused_name)
        else:
            w = numpy_helper.from_array(np.concatenate([numpy_helper.to_array(w_) for w_ in ws], axis=1), fused_name)
        sizes = numpy_helper.from_array(np.array([w_.dims[1] for w_ in ws], np.int64), name + "_split_sizes")
        g.initializer.extend([w, sizes])
        fused[members[0].name] = [
            helper.make_node("MatMul", [x, w.name], [name + "_out"], name=name),
            helper.make_node("Split", [name + "_out", sizes.name], [m.output[0] for m in members], name=name + "_split", axis=-1),
        ]
        drop.update(m.name for m in members)
    if not fused:
        return 0
    nodes = []
    for n in g.node:  # the fused pair goes where the group's first MatMul was: its input is ready there
        nodes += fused.get(n.name, []) if n.name in drop else [n]
    set_nodes(g, nodes)
    return len(fused)


def mixed_8bit_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMuls whose constant weight is one of MIXED_8BIT's projections."""
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits
            and any(p in "." + n.input[1] for p in MIXED_8BIT)]


def quantize_vision(path: Path, precision: str) -> onnx.ModelProto:
    """The vision graph at path (its weights in external data beside it) at a weight-only precision. The fp32 graph's
    w8a8 (int8_matmuls) never holds the float weights in this process beside ORT's quantizer: the Gemm weights are
    transposed one at a time into the data file path + ".kn.data" (gemm_to_matmul's data; the caller deletes it),
    and the quantizer reads the graph from disk (at Qwen3.5-2B's 4096-patch tower the stage peaked at 10.8 GB RSS)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    if precision == "w8a8" and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in model.graph.input):
        gemm_to_matmul(model, data=kn_data(path))
        for init in model.graph.initializer:  # small tensors in the graph, as onnx.save's threshold leaves them
            if external_data_helper.uses_external_data(init) and _external_length(init) < 1024:
                external_data_helper.load_external_data_for_tensor(init, str(path.parent))
                init.data_location = onnx.TensorProto.DEFAULT
                del init.external_data[:]
        onnx.save(model, str(path))
        del model
        return int8_matmuls(path)
    external_data_helper.load_external_data_for_model(model, str(path.parent))
    if precision in OFFSETS:
        model = gemm_to_matmul(model)
        set_nodes(model.graph, quantize_offsets.offset_nodes(model, ACCURACY_LEVEL[precision], exclude=set()))
        return model
    return weight_only(gemm_to_matmul(model), WEIGHT_ONLY_BITS[precision], accuracy_level=ACCURACY_LEVEL[precision])


def kn_data(path: Path) -> Path:
    """Where quantize_vision's w8a8 puts the transposed weights of the graph at path."""
    return path.with_name(path.name + ".kn.data")


def _external_length(init: onnx.TensorProto) -> int:
    return int({e.key: e.value for e in init.external_data}.get("length", 0))


def int8_matmuls(model: onnx.ModelProto | Path) -> onnx.ModelProto:
    """The vision graph's w8a8: every constant-weight MatMul in int8 through ORT's dynamic quantization
    (onnxruntime.quantization.quantize_dynamic): int8 weights per output channel, the activations quantized to
    uint8 at run time (one scale per tensor), computed by MLAS's int8 GEMM (DynamicQuantizeMatMul). A tile's
    MatMuls have 1,000+ rows: there MatMulNBits (one call per block of activations) is slower than fp32 and the
    int8 GEMM ~2.7x faster (docs/performance.md#vision-encode)."""
    import logging
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a warning and a line per tensor
    try:
        with tempfile.TemporaryDirectory() as d:
            out = f"{d}/int8.onnx"
            quantize_dynamic(model if isinstance(model, onnx.ModelProto) else str(model), out, op_types_to_quantize=["MatMul"], per_channel=True,
                             weight_type=QuantType.QInt8, use_external_data_format=True)
            return onnx.load(out)
    finally:
        root.setLevel(level)


def int8_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8: table ≈ q * scale[:, None]."""
    amax = np.abs(table).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale
