"""The Qualcomm HTP target: static QDQ graphs (16-bit activations, 8- or 4-bit weights) with a uint8 KV cache.

A float bundle (exported with a moderate mask value) is run by the runtime on calibration samples;
its recorded graph inputs calibrate each graph separately (onnxruntime.quantization's QNN config,
MinMax). The KV cache tensors get one uint8 encoding per layer and graph (past input == new-rows
output, so that rows written by a graph read back correctly), forced with tensor overrides; then
the graph edges around the cache are cut so that the cache I/O itself is uint8. Prefill and decode
are calibrated apart, so their encodings differ: the runtime re-quantizes after prefill (kv_cache.py).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ...format import manifest as mf
from ...runtime.weights import release_freed_heap
from .. import fuse, graphs, onnx_names
from . import head as htp_head, precisions as htp_precisions, verify as htp_verify, int4_blocks, qnn_context, softcap_sigmoid
from ..cache_kinds import encoded_edges
from .calibrate import calibrate, kv_ranges, uint8_encoding

HTP_MASK_VALUE = -100.0  # hidden attention slots: exp(-100) ~ 0, and the mask keeps a small 16-bit range


PASS_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")


def _cut_kv_edges(model: onnx.ModelProto, inputs: list[str], outputs: dict[str, str],
                  want: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """Make the KV cache I/O uint8 with the encodings ``want``; returns each input's (scale, zero_point) as the graph has it.

      input x (float) -> [Reshape…] -> Q -> …    becomes   input x (uint8) -> DQ -> [Reshape…] -> Q -> …
      … -> Q -> p -> DQ -> output y              becomes   … -> Q -> output y (uint8)
    (an output the graph also reads itself, a conv layer's rows, keeps its DQ for those readers: y -> DQ -> …).
    The input keeps the canonical QDQ form (a DequantizeLinear right at the input): with the uint8
    input fed straight into a Reshape, the QNN HTP backend misread the cache (seen on its simulator). outputs maps each output to the input whose
    encoding it must have (rows a graph writes are read back by the same graph): that output's last
    QuantizeLinear gets exactly the input's scale and zero point.

    want (input -> (scale, zero point)) sets the encoding of the QuantizeLinear an input reaches: ORT
    calibrates that tensor (the input after a Reshape) by itself, and a graph whose calibration calls
    all saw an empty cache -- a prefill over prompts shorter than its AR -- gets a zero range there
    (scale ~0: every cache row written or read back would be clipped to zero)."""
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}

    def consumers(t):
        return [n for n in g.node if t in n.input]

    def enc(node) -> tuple[float, int]:
        return float(numpy_helper.to_array(inits[node.input[1]])), int(numpy_helper.to_array(inits[node.input[2]]))

    found: dict[str, tuple[float, int]] = {}
    drop = []
    for name in inputs:
        cs = consumers(name)
        while len(cs) == 1 and cs[0].op_type in PASS_THROUGH:
            cs = consumers(cs[0].output[0])
        if len(cs) != 1 or cs[0].op_type != "QuantizeLinear":
            raise ValueError(f"KV input {name} does not reach a single QuantizeLinear through data-movement ops")
        sc, zp = want[name]  # the scale/zero-point initializers are this tensor's own (its Q and DQ)
        for init, val in ((inits[cs[0].input[1]], np.array(sc, np.float32)), (inits[cs[0].input[2]], np.array(zp, np.uint8))):
            if numpy_helper.to_array(init).dtype != val.dtype:
                raise ValueError(f"KV input {name} is quantized as {numpy_helper.to_array(init).dtype}, not uint8")
            init.CopyFrom(numpy_helper.from_array(val, init.name))
        found[name] = enc(cs[0])
        # canonical QDQ: uint8 input -> DequantizeLinear(its encoding) -> [Reshape…] -> QuantizeLinear -> …
        deq = name + "_kv_dequantized"
        for n in g.node:
            for j, i in enumerate(n.input):
                if i == name:
                    n.input[j] = deq
        g.node.insert(0, helper.make_node("DequantizeLinear", [name, cs[0].input[1], cs[0].input[2]], [deq],
                                          name=name + "_kv_DequantizeLinear"))
        next(v for v in g.input if v.name == name).type.tensor_type.elem_type = onnx.TensorProto.UINT8
    for name, like in outputs.items():
        dq = next((n for n in g.node if name in n.output), None)
        q = next((n for n in g.node if dq is not None and dq.input[0] in n.output), None)
        if dq is None or dq.op_type != "DequantizeLinear" or q is None or q.op_type != "QuantizeLinear":
            raise ValueError(f"KV output {name} is not produced by QuantizeLinear -> DequantizeLinear")
        scale, zp = found[like]
        g.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), f"{name}_kv_scale"))
        g.initializer.append(numpy_helper.from_array(np.array(zp, np.uint8), f"{name}_kv_zero_point"))
        q.input[1], q.input[2] = f"{name}_kv_scale", f"{name}_kv_zero_point"
        users = [n for n in g.node if name in n.input]
        if users:  # the rows are read inside the graph too (a conv layer's, concatenated after its window): their
            inner = name + "_kv_inner"  # DequantizeLinear stays, for those readers only
            for n in users:
                n.input[:] = [inner if i == name else i for i in n.input]
            dq.output[0] = inner
        else:
            drop.append(dq)
        onnx_names.rename_tensor(g, dq.input[0], name, skip=dq)
        if users:
            dq.input[0] = name
        next(v for v in g.output if v.name == name).type.tensor_type.elem_type = onnx.TensorProto.UINT8
    keep = [n for n in g.node if not any(n is d for d in drop)]
    del g.node[:]
    g.node.extend(keep)
    del g.value_info[:]  # intermediate types changed (uint8 through the data-movement ops); ORT re-infers them
    return found


def at_opset21(model: onnx.ModelProto) -> None:
    """Raise an opset-20 graph to opset 21 in place. ORT's QDQ quantizer needs 21 for 16-bit activations, and
    converts with onnx's version converter: a serialized copy that must stay under protobuf's 2 GB (a 1B decoder's
    float weights do not) and three more copies of the weights in memory (~6 GB at InternVL3.5-1B). From 20 to 21
    the operators changed only in the types they take (int4, float8), except GroupNormalization, whose meaning
    changed: a graph with it is left to the converter."""
    ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version == 20 and "GroupNormalization" not in ops:
            o.version = 21


def quantize_graph(src: Path, dst: Path, reader, overrides: dict | None = None) -> None:
    """16-bit activations, uint8 per-channel weights (4-bit ones are re-made afterwards: int4_blocks.requantize)."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    with graphs._quiet():
        cfg = get_qnn_qdq_config(str(src), reader, activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8,
                                 per_channel=True, init_overrides=overrides)
        # (no CalibMaxIntermediateOutputs: ORT 1.32's MinMax calibrator drops, not folds, the data it clears;
        # the augmented model only outputs per-tensor ReduceMin/ReduceMax, so memory stays small anyway)
        cfg.use_external_data_format = True
        quantize(str(src), str(dst), cfg)


def state_edges(m: mf.Manifest) -> list[tuple[str, int, str, str]]:
    """(encoding kind, its index, cache input, new-rows output) of every state tensor, by its layer's cache kind
    (cache_kinds.encoded_edges: an attention layer's "key" and "value", a conv layer's "conv")."""
    return encoded_edges(m.kv.layers)


def kv_overrides(enc: dict, m: mf.Manifest) -> dict:
    """One uint8 encoding per layer for the cache input and the new-rows output of K and V (and a conv layer's rows)."""
    from onnxruntime.quantization import QuantType

    out = {}
    for kind, i, fin, fout in state_edges(m):
        s, zp = enc[kind][i]
        for name in (fin, fout):
            out[name] = [{"quant_type": QuantType.QUInt8, "scale": np.array(s, np.float32), "zero_point": np.array(zp, np.uint8)}]
    return out


def _kv_names(m: mf.Manifest, enc: dict):
    """(cache inputs, new-rows output -> its input, cache input -> (scale, zero point))."""
    edges = state_edges(m)
    kin = [fin for _, _, fin, _ in edges]
    kout = {fout: fin for _, _, fin, fout in edges}
    want = {fin: tuple(enc[kind][i]) for kind, i, fin, _ in edges}
    return kin, kout, want


def _float_graph(model: onnx.ModelProto, dst: Path, m: mf.Manifest, enc: dict | None) -> dict:
    """An fp16 graph: the float graph (RMSNorm fused) with uint8 KV edges; returns the encodings it has."""
    got = {}
    if enc is not None:
        _, kout, want = _kv_names(m, enc)
        htp_precisions.float_kv_edges(model, want, kout)
        got = want
    graphs.rewrite(dst, model)
    return got


def _save_for_qdq(model: onnx.ModelProto, full: Path, m: mf.Manifest, prec: str, head: str | None) -> tuple[dict, dict]:
    """The float graph to quantize at prec (head: the decoder's lm head precision) saved as full (+ its .data), the
    4-bit weights decomposed first; returns (float weights, int4 grids) for int4_blocks.requantize. The caller then
    drops model: with upb protobuf a model's arena keeps every weight it ever held until the model itself goes (~6 GB
    at InternVL3.5-1B's decoder), and ORT's quantizer loads the graph again twice."""
    four = ("w4a16", "w4a16o")
    lm = htp_precisions.head_node(model, m.decoder.logits_output) if head and (prec in four or head in four) else None
    body = {node for node, _ in int4_blocks.weight_axes(model).values()} - {lm}
    sym4 = (body if prec == "w4a16" else set()) | ({lm} if head == "w4a16" else set())
    off4 = (body if prec == "w4a16o" else set()) | ({lm} if head == "w4a16o" else set())
    floats = int4_blocks.float_weights(model, exclude={n.name for n in model.graph.node} - sym4) if sym4 else {}
    grids = int4_blocks.offsets_decompose(model, exclude={n.name for n in model.graph.node} - off4) if off4 else {}
    at_opset21(model)
    onnx.save(model, str(full), save_as_external_data=True, all_tensors_to_one_file=True,
              location=full.stem + ".data", size_threshold=1024)
    return floats, grids


def _qdq_graph(full: Path, int4: tuple[dict, dict], dst: Path, rec, m: mf.Manifest, enc: dict | None,
               like: onnx.ModelProto | None = None, as_stored: bool = False) -> tuple[dict, int]:
    """The QDQ graph of the float graph full (_save_for_qdq; int4: what it returned), a16; returns (KV encodings, the
    number of block-wise int4 weights). like: the QDQ graph whose quantization it takes (the verify graph: decode's);
    as_stored: the step's own K/V rows attended as the cache stores them (htp_verify.attend_as_stored)."""
    floats, grids = int4
    overrides = kv_overrides(enc, m) if enc is not None else None
    quantize_graph(full, dst, rec.reader(), overrides)
    os.remove(full)
    os.remove(full.with_name(full.stem + ".data"))
    q = onnx.load(str(dst))
    blocks = int4_blocks.requantize(q, floats, grids) if floats or grids else 0
    got = {}
    if enc is not None:
        kin, kout, want = _kv_names(m, enc)
        got = _cut_kv_edges(q, kin, kout, want)
        if as_stored:
            htp_verify.attend_as_stored(q, list(kout))
    if like is not None:
        htp_verify.copy_encodings(like, q)
    graphs.rewrite(dst, q)
    return got, blocks


def quantize_bundle(float_dir: Path, out_dir: Path, samples, *, target: dict, precisions: dict[str, str] | None = None,
                    tokens: int = 32, keep_qdq: bool = False, shared_context: bool = False, progress=None) -> mf.Manifest:
    """float bundle -> HTP bundle in out_dir (QNN context binaries compiled for target (qnn_context.resolve_target),
    with keep_qdq also the QDQ / float graphs and their data; manifest). precisions: htp_precisions.parse's
    {vision, prefill, decode, lm_head} (default: w8a16 everywhere)."""
    prec = precisions or htp_precisions.parse(None)
    m = mf.load(float_dir)
    rec = calibrate(float_dir, samples, tokens)
    if progress:
        progress("calibration")
    for name, r in rec.items():
        if not r.feeds:
            what = "images" if name == "vision" else "prompts"
            raise ValueError(f"the calibration set has no {what}: the {name} graph cannot be calibrated")
    encodings = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    gspecs = {}
    kind = m.decoder.kind  # (the float bundle's: rows_static)
    decoders = ["prefill", "decode", *(["verify"] if kind.verify_ar else [])]
    own_head = None  # the lm head as its own graph (htp_head): the decoder graphs end at the final norm
    for name in ("vision", *decoders):
        model, fused = fuse.prepare_for_qdq(onnx.load(str(float_dir / m.graphs[name].file)))  # with weights; RMSNorm fused
        if "head" in prec and name != "vision":
            own_head = htp_head.split(model, m.decoder.logits_output, m.decoder.hidden_size, m.decoder.vocab_size)
        softcap_sigmoid.softcap_as_sigmoid(model)
        enc = like = None
        if name != "vision":  # (the verify graph reads and writes decode's cache: decode's encoding)
            ranges = kv_ranges(rec["prefill" if name == "prefill" else "decode"])
            enc = {kind: [uint8_encoding(lo, hi) for lo, hi in r] for kind, r in ranges.items()}
        if name == "verify":  # the decode graph at AR = verify_ar: decode's encodings everywhere (htp_verify.py)
            like = onnx.load(str(out_dir / "decode.onnx")) if prec["decode"] != "fp16" else None
            rec["verify"] = htp_verify.TiledFeeds(rec["decode"], m.decoder, kind.verify_ar, m.kv.max_context)
        p = prec["decode" if name == "verify" else name]
        head = prec["lm_head"] if name != "vision" and p != "fp16" and "head" not in prec else None
        dst = out_dir / f"{name}.onnx"
        full, int4 = out_dir / f"{name}.float.onnx", None
        if p == "fp16":
            got, blocks = _float_graph(model, dst, m, enc), 0
        else:
            int4 = _save_for_qdq(model, full, m, p, head)
        del model
        gc.collect()
        release_freed_heap()  # (a graph's float weights, freed: ~2 GB at InternVL3.5-1B that RSS would keep)
        if int4 is not None:
            got, blocks = _qdq_graph(full, int4, dst, rec[name], m, enc, like,
                                     as_stored=name in ("decode", "verify") and bool(kind.verify_ar))
        del like, int4
        if enc is not None:  # the graph's own encodings, per kind in layer order
            encodings[name] = {e: [] for e in enc}
            for e, _, fin, _ in state_edges(m):
                encodings[name][e].append(list(got[fin]))
        ins, outs = graphs.io_specs(dst)
        weights = {"activations": "float16" if p == "fp16" else "uint16", "weights": htp_precisions.WEIGHTS[p],
                   "blockwise_int4": blocks, "fused_rms_norms": fused,
                   "calibration_calls": rec["decode" if name == "verify" else name].calls,
                   "calibration_samples": len(rec["decode" if name == "verify" else name].feeds)}  # (Recorder)
        if name != "vision":
            weights["lm_head"] = "graph head" if "head" in prec else head or "fp16"
        gspecs[name] = mf.GraphSpec(file=f"{name}.onnx", precision=htp_precisions.LABEL[p], inputs=ins, outputs=outs,
                                    weights=weights, qnn_options=dict(htp_precisions.QNN_OPTIONS.get(p, {})))
        if progress:
            progress(name)
    files = []
    if own_head is not None:
        p, dst = prec["head"], out_dir / "head.onnx"
        reader = htp_head.HiddenReader(float_dir / m.graphs["decode"].file, rec["decode"], m.decoder.logits_output)
        if p == "fp16":
            _, blocks = _float_graph(own_head, dst, m, None), 0
        else:
            int4 = _save_for_qdq(own_head, out_dir / "head.float.onnx", m, p, None)
            own_head = None
            gc.collect()
            release_freed_heap()
            _, blocks = _qdq_graph(out_dir / "head.float.onnx", int4, dst, reader, m, None)
        ins, outs = graphs.io_specs(dst)
        weights = {"activations": "float16" if p == "fp16" else "uint16", "weights": htp_precisions.WEIGHTS[p],
                   "blockwise_int4": blocks, "calibration_calls": len(reader.rows)}
        gspecs["head"] = mf.GraphSpec(file="head.onnx", precision=htp_precisions.LABEL[p], inputs=ins, outputs=outs,
                                      weights=weights, qnn_options=dict(htp_precisions.QNN_OPTIONS.get(p, {})))
        graphs.share_weights(out_dir, ["head.onnx"], "head.data")
        files = ["head.onnx", "head.data"]
        if progress:
            progress("head")
    graphs.share_weights(out_dir, ["vision.onnx"], "vision.data")
    graphs.share_weights(out_dir, [f"{g}.onnx" for g in decoders], "decoder.data")
    gspecs = {k: dataclasses.replace(g, **graphs.weight_table(out_dir / g.file)) for k, g in gspecs.items()}
    for f in ("embed.npy", "tokenizer.json") + ((m.decoder.embedding_scale_file,) if m.decoder.embedding_scale_file else ()):
        shutil.copyfile(float_dir / f, out_dir / f)
    files += ["vision.onnx", "vision.data", *(f"{g}.onnx" for g in decoders), "decoder.data", "embed.npy", "tokenizer.json"]
    if m.decoder.embedding_scale_file:
        files.append(m.decoder.embedding_scale_file)
    gspecs, files, qnn = qnn_context.compile_bundle(out_dir, gspecs, files, target, keep_qdq, shared_context)
    if progress:
        progress("compile")
    target = {"name": "htp", **target, **qnn}
    dec = dataclasses.replace(m.decoder, embedding_file="embed.npy",
                              kind=dataclasses.replace(kind, hidden_output=htp_head.HIDDEN if "head" in prec else None))
    return dataclasses.replace(
        m, graphs=gspecs, kv=dataclasses.replace(m.kv, dtype="uint8", encodings=encodings), target=target,
        files=mf.list_files(out_dir, files), decoder=dec,
    )
