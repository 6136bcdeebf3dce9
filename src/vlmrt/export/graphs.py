"""torch -> ONNX at fixed shapes, family-agnostic.

Each graph is exported with the dynamo exporter into its own folder entry; `share_weights`
then stores every large initializer once, content-addressed, in one data file that the
prefill and decode graphs (the same decoder at two AR sizes) both point into.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import hashlib
import io
import logging
import math
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import torch
from onnx import external_data_helper

from ..format.manifest import TensorSpec
from .cache_kinds import CACHE_KINDS, CacheLayout, batchable, padded, state_names
from .decoder_inputs import ROW_INPUT, SPAN_INPUT, VALID_ROWS, decoder_inputs

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class GraphLayout(NamedTuple):
    """How a decoder graph of an attention kind (families/layers.py ATTENTION_KINDS) takes its cache.
    out_prefix: its state outputs are the step's new rows (new_key_i) or the whole updated buffers (present_key_i).
    in_place: ORT's GroupQueryAttention over cache buffers [B, kv_heads, max_context, head_dim] that the graph updates
    itself (a symbolic AR, step inputs seqlens_k and total_sequence_length, export/gqa_onnx.py's translation, the
    weights named and q/k/v packed, a batch dim where the layers take one, the LM head's MatMul first); else the rows
    contract: the cache [ctx, kv_dim] per layer under an additive attention_mask [ar, ctx + ar]."""

    out_prefix: str
    in_place: bool


ROWS, IN_PLACE = GraphLayout("new", False), GraphLayout("present", True)
LAYOUTS = {"rows_copy_free": ROWS, "rows_concat": ROWS, "gqa_in_place": IN_PLACE}


@contextlib.contextmanager
def _quiet():
    """The dynamo exporter prints progress and warnings per graph; keep the CLI output ours."""
    buf = io.StringIO()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def export_graph(module: torch.nn.Module, args: tuple, input_names: list[str], output_names: list[str], path: Path,
                 dynamic_shapes: tuple | None = None, translations: dict | None = None) -> None:
    """Export module at the shapes of args (static unless dynamic_shapes names a dim) to path (+ path.data);
    translations: torch op -> onnxscript function for ops of our own (export/gqa_onnx.py)."""
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=input_names, output_names=output_names, optimize=True,
            dynamic_shapes=dynamic_shapes, custom_translation_table=translations,
        )
        program.save(str(path), external_data=True)
    del program
    forget_trace()
    gc.collect()  # (the exported program is in reference cycles: its constants would outlive this call)
    onnx.checker.check_model(str(path))


def forget_trace() -> None:
    """Drop what torch.export keeps of its last trace: its non-strict tracer leaves the traced graph's nodes in a
    module-level map (torch.fx.experimental.proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT, read only by its
    fake-tensor leak check, cleared by the next trace), and the nodes hold the graph and through it the module traced
    with its weights: the decoder's float32 torch weights (GBs at the E2B shape) outlived its trace and every ONNX
    pass after it (export memory: docs/gemma4.md)."""
    from torch.fx.experimental import proxy_tensor

    proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()


def io_specs(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    m = onnx.load(str(path), load_external_data=False)

    def spec(vi) -> TensorSpec:
        t = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        return TensorSpec(name=vi.name, shape=[d.dim_param or d.dim_value for d in t.shape.dim], dtype=dtype)

    return [spec(v) for v in m.graph.input], [spec(v) for v in m.graph.output]


class CastIO(torch.nn.Module):
    """Run `inner` in compute dtype behind graph I/O in io dtype (float tensors only).
    Casts `inner` in place: callers pass their own copy."""

    def __init__(self, inner: torch.nn.Module, compute: torch.dtype, io: torch.dtype):
        super().__init__()
        self.inner, self.compute, self.io = inner.to(compute), compute, io

    def forward(self, *args):
        args = [a.to(self.compute) if a.is_floating_point() else a for a in args]
        out = self.inner(*args)
        if isinstance(out, tuple):
            return tuple(o.to(self.io) if o.is_floating_point() else o for o in out)
        return out.to(self.io)


class TokenRows(torch.nn.Module):
    """inner(inputs_embeds + token_rows * token_scales, *rest): an int8 embedding row and its scale as graph inputs
    [ar, hidden] int8, [ar] float32 (the last two), multiplied in float32 and cast to the I/O dtype as the host's
    TokenEmbedding.embed does, so a decode step's row goes straight from the table into the bound input (scale 0 for the
    rows that come in inputs_embeds: prompt blocks, image rows, lookahead drafts)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):  # (one *args, as CastIO: the export's dynamic shapes are one tuple)
        embeds, *rest, rows, scales = args
        return self.inner(embeds + (rows.float() * scales[:, None]).to(embeds.dtype), *rest)


def largest_matmul_first(model: onnx.ModelProto) -> None:
    """Move the MatMulNBits node with the largest weight (the LM head) to the front of the node list. ORT prepacks
    the weights in node order and drops each original after packing it, so the process's peak is the packed copies
    plus the original being packed: packed last, the 14 MB head of SmolLM2 was on top of all the others (peak RSS
    +17 MB; docs/performance.md#memory). ORT runs nodes in their topological order whatever the list's order, so
    the graph computes the same; the list is then not topologically sorted, which ORT does not need."""
    g = model.graph
    sizes = {i.name: math.prod(i.dims) for i in g.initializer}
    nbits = [(sizes.get(n.input[1], 0), k) for k, n in enumerate(g.node) if n.op_type == "MatMulNBits"]
    if not nbits:
        return
    _, k = max(nbits)
    node = g.node.pop(k)
    g.node.insert(0, node)


def compute_dtype(precision: str, io_dtype: str) -> str:
    """fp32/fp16 graphs compute in that type; weight-only graphs in the I/O type."""
    return precision if precision in TORCH_DTYPES else io_dtype


def export_vision(vision: torch.nn.Module, inputs: dict, outputs: list[str], io_dtype: str, precision: str,
                  path: Path) -> None:
    """trace_vision, then finish_vision."""
    trace_vision(vision, inputs, outputs, io_dtype, precision, path)
    finish_vision(path, precision)


def trace_vision(vision: torch.nn.Module, inputs: dict, outputs: list[str], io_dtype: str, precision: str,
                 path: Path) -> None:
    """The vision module at the shapes of its example inputs by role (families.vision_examples: "patches" first, the
    graph input pixel_patches; the others named by role, manifest vision.extra_inputs), float inputs and outputs in
    the I/O dtype (int64 inputs as they are); outputs: the graph's output names (image_embeds, then row outputs).
    The graph as torch exports it, in float: finish_vision quantizes it without the torch module (the caller frees
    it first: export memory, as trace_decoder / finish_decoder)."""
    io = TORCH_DTYPES[io_dtype]
    args = tuple(x.to(io) if x.is_floating_point() else x for x in inputs.values())
    names = ["pixel_patches" if role == "patches" else role for role in inputs]
    module = CastIO(copy.deepcopy(vision), TORCH_DTYPES[compute_dtype(precision, io_dtype)], io)
    export_graph(module, args, names, outputs, path)


def finish_vision(path: Path, precision: str) -> None:
    """A traced vision graph (trace_vision) at its weight-only precision, written back to path (+ path.data)."""
    from .cpu import quantize

    if precision in quantize.WEIGHT_ONLY_BITS:
        with _quiet():
            model = quantize.quantize_vision(path, precision)
            rewrite(path, model)
        del model
        quantize.kn_data(path).unlink(missing_ok=True)


def rewrite(path: Path, model: onnx.ModelProto) -> None:
    """Save a (changed) graph back to path + path.data."""
    data = Path(str(path) + ".data")
    if data.exists():
        os.remove(data)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024)


def trace_decoder(decoder, *, attention: str, ar: int, max_context: int, hidden: int,
                   io_dtype: str, precision: str, head: str, path: Path, cpu: bool = True, dynamic_context: bool = False,
                   dynamic_ar: bool = False, hessian=None, token_rows: bool = False, kv_quant: list | None = None) -> "DecoderTrace":
    """A decoder graph (families.DecoderModule) of the attention kind (families/layers.py ATTENTION_KINDS; its
    GraphLayout: LAYOUTS) at the shapes of its example inputs (export/decoder_inputs.py: inputs_embeds [ar, hidden],
    position_ids [rope rows, ar], the row input, the step inputs, the state per layer by its cache kind).
    cpu: the graph is for the CPU/CUDA EPs (not a float graph the HTP target quantizes): RMSNorm chains become one
    fused op.
    dynamic_context: the cache inputs are [ctx, kv_dim] and the mask [ar, ctx + ar] for any ctx <= max_context
    (the dim is named "ctx"), so that one graph reads only the prefix of the cache that a step needs.
    dynamic_ar (with dynamic_context): the step's token count is symbolic too ("ar", 1..ar), so that one graph
    (one session, one prepacked copy of the weights) serves the prefill blocks and the 1-token decode steps;
    such a graph also takes logit_rows [r] (CausalDecoder.logit_rows): the logits are [r, vocab], those rows' only
    (the last row for a prefill block or a decode step, all of a lookahead verify step's).
    attention gqa_in_place (a CPU graph, with dynamic_context and dynamic_ar): ORT's GroupQueryAttention over cache
    buffers [B, kv_heads, max_context, head_dim] that the graph updates in place: inputs inputs_embeds, position_ids,
    seqlens_k [B], total_sequence_length, past_*, logit_rows; outputs logits, present_*, next_token. B sequences of
    ar / B tokens each (export/batch_dim.py; B = 1 but for the batched decode step).
    hessian: the GPTQ precisions' calibration (quantize.quantize_decoder).
    token_rows: two more inputs, token_rows [ar, hidden] int8 and token_scales [ar] (TokenRows).
    kv_quant: a gqa_in_place graph's quantized cache, the manifest's attention layers with their quant
    (export/cpu/kv_quant.py: the GroupQueryAttention nodes store K and V in int8 / uint8 buffers).
    A fixed-AR rows graph (a padded last prompt block) of a decoder with layers whose state is not per slot
    (cache_kinds.padded False: a recurrent layer) takes valid_rows [ar] float32 last (static_valid_rows)."""
    from ..families.layers import ATTENTION_KINDS
    from . import gqa_onnx, linear_attention_onnx

    layout = LAYOUTS[attention]
    if layout.in_place and not (cpu and dynamic_context and dynamic_ar):
        raise ValueError(f"a {attention} graph is a CPU graph with a symbolic context and AR")
    if kv_quant and not layout.in_place:
        raise ValueError("a quantized cache is GroupQueryAttention's (attention gqa_in_place)")
    dt = TORCH_DTYPES[io_dtype]
    # the one copy (CastIO casts it); positions of a step: pos..pos+ar-1 with pos < max_context (in place: the
    # buffers' max_context slots hold the step's rows too)
    decoder = decoder.with_options(attention=attention, logit_rows=dynamic_ar,
                                   rope_positions=max_context + (0 if layout.in_place else ar))
    valid = static_valid_rows(decoder.layer_kinds, attention, dynamic_ar)
    decoder.valid_rows = valid  # (the copy's: DecoderModule.valid_rows)
    decoder.window_capacity = window_capacity(decoder, attention, ar)
    module = CastIO(decoder, TORCH_DTYPES[compute_dtype(precision, io_dtype)], dt)
    n = torch.export.Dim("ar", min=1, max=ar) if dynamic_ar else None
    dims = {"inputs_embeds": {0: n}, "position_ids": {1: n}, ROW_INPUT: {0: n}, SPAN_INPUT: {0: n}} if dynamic_ar else {}
    if layout.in_place:
        step = {"seqlens_k": torch.tensor([ar - 1], dtype=torch.int32),
                "total_sequence_length": torch.tensor(ar, dtype=torch.int32)}
        cache = CacheLayout(lambda h, d: (torch.zeros(1, h, max_context, d, dtype=dt), None), (1,), dt)
    else:
        step = {"attention_mask": torch.zeros(ar, max_context + ar, dtype=dt)}
        ctx = torch.export.Dim("ctx", min=2, max=max_context) if dynamic_context else None
        cache = CacheLayout(lambda h, d: (torch.zeros(max_context, h * d, dtype=dt), {0: ctx}), (), dt)
        # (with a symbolic AR the exporter derives the mask's width; else ctx + ar)
        if dynamic_context:
            dims["attention_mask"] = {0: n, 1: torch.export.Dim.AUTO} if dynamic_ar else {1: ctx + ar}
    state = [ex for i, kind in enumerate(decoder.layer_kinds) for ex in CACHE_KINDS[kind].examples(decoder, cache, i)]
    dims.update(zip(state_names(decoder.layer_kinds)[0], (d for _, d in state)))
    tail = {}
    if dynamic_ar:
        tail["logit_rows"] = torch.arange(ar, dtype=torch.int64)
        dims["logit_rows"] = {0: torch.export.Dim("rows", min=1, max=ar)}
    if valid:
        tail[VALID_ROWS] = torch.ones(ar)
    if token_rows:  # [ar, hidden] int8, [ar] float32
        module = TokenRows(module)
        tail.update(token_rows=torch.zeros(ar, hidden, dtype=torch.int8), token_scales=torch.zeros(ar))
        dims.update(token_rows={0: n}, token_scales={0: n})
    inputs = decoder_inputs(decoder, torch.zeros(ar, hidden, dtype=dt), step=step, state=[t for t, _ in state],
                            tail=tail)
    outputs = ["logits", *state_names(decoder.layer_kinds, layout.out_prefix)[1],
               *(["next_token"] if ATTENTION_KINDS[attention].argmax else [])]
    # CastIO.forward(*args): the dynamic shapes are one varargs entry
    dynamic = (tuple(dims.get(name) for name in inputs),) if dynamic_context else None
    export_graph(module, tuple(inputs.values()), list(inputs), outputs, path, dynamic,
                 {**linear_attention_onnx.TABLE, **(gqa_onnx.TABLE if layout.in_place else {})})
    return DecoderTrace(path, layout.in_place, precision, head, hessian, cpu, decoder.layer_kinds, kv_quant or [],
                        dynamic_ar and "attention_mask" in inputs)


class DecoderTrace(NamedTuple):
    """A decoder graph as torch exported it (trace_decoder), and what finish_decoder's ONNX passes need: they read
    the graph back without the torch module, so the caller can free the torch weights first (export memory)."""

    path: Path
    in_place: bool
    precision: str
    head: str
    hessian: object
    cpu: bool
    layer_kinds: tuple
    kv_quant: list  # the quantized attention layers (manifest entries)
    dynamic_mask: bool  # a symbolic-AR rows graph's attention_mask: its derived width is named "ctx + ar"


def export_decoder(decoder, **options) -> None:
    """trace_decoder, then finish_decoder (the options: trace_decoder's)."""
    finish_decoder(trace_decoder(decoder, **options))


def finish_decoder(tr: DecoderTrace) -> None:
    """The ONNX passes of a traced decoder graph (trace_decoder), on one copy of the graph read back once: its
    weights named (in place), weight-only quantization, the fused RMSNorm, packed q/k/v, the batch dim, the
    quantized cache, the LM head's MatMul first; written back once."""
    from . import batch_dim, fuse, gqa_onnx
    from .cpu import quantize

    path = tr.path
    quantized = tr.precision in quantize.WEIGHT_ONLY_BITS or tr.head in quantize.WEIGHT_ONLY_BITS
    if tr.in_place or quantized or tr.cpu:
        model = onnx.load(str(path), load_external_data=not quantized)  # (quantize_decoder reads the data itself)
        changed = _name_weights(model) if tr.in_place else 0
        if quantized:
            with _quiet():
                model = quantize.quantize_decoder(model, tr.precision, tr.head, "logits", tr.hessian, folder=path.parent)
            changed = True
        if tr.cpu:
            changed = fuse.fuse_rms_norm(model) or changed
            if tr.in_place:
                gqa_onnx.pack_qkv(model)
                if batchable(tr.layer_kinds):  # B sequences per call: B = len(seqlens_k)
                    batch_dim.add_batch_dim(model, "seqlens_k")
                if tr.kv_quant:
                    from .cpu import kv_quant as kvq

                    kvq.quantize_cache(model, tr.kv_quant)
                largest_matmul_first(model)
                changed = True
        if changed:
            rewrite(path, model)
        del model
    if tr.dynamic_mask:  # the exporter names the mask's derived width s<N>
        model = onnx.load(str(path), load_external_data=False)
        mask = next(i for i in model.graph.input if i.name == "attention_mask")
        width = mask.type.tensor_type.shape.dim[1].dim_param
        for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param == width:
                    d.dim_param = "ctx + ar"
        onnx.save(model, str(path))


def window_capacity(decoder, attention: str, ar: int) -> int:
    """The rows of a windowed cache's buffers (DecoderModule.window_capacity) for a graph of this attention kind and
    prefill block: window + ar for a gqa_in_place graph of a decoder with a window (ORT's CPU GroupQueryAttention
    with sliding_window_cache; the slack above the window is how many slots pass between two evictions: docs/
    gemma4.md); 0 (rows by slot) for the rows kinds (static graphs, --attention portable)."""
    if not decoder.window or not LAYOUTS[attention].in_place:
        return 0
    return decoder.window + ar


def static_valid_rows(layer_kinds, attention: str, dynamic_ar: bool) -> bool:
    """Whether a decoder graph takes valid_rows: a fixed-AR rows graph (the runtime pads a prompt's last block to its
    AR) of layers not all of whose state is per slot (the host cannot drop a padded row's part of a recurrent state:
    the graph keeps the state at the last real row)."""
    return not dynamic_ar and not LAYOUTS[attention].in_place and not padded(layer_kinds)


def _name_weights(model: onnx.ModelProto) -> int:
    """The in_place graph's 3-D MatMuls get their weights as folded transposes named val_N: give each the module path
    the exporter records (`<module>.weight_kn`, as gemm_to_matmul names them), which --quant's per-module choices
    (quantize.MIXED_8BIT) match on. Returns how many were renamed."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    renamed = 0
    for n in g.node:
        scopes = next((p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        w = n.input[1] if n.op_type == "MatMul" and len(n.input) > 1 else None
        if not scopes or w not in inits or uses[w] != 1 or not w.startswith("val_"):
            continue
        module = ast.literal_eval(scopes)[-2]  # ['', 'inner', ..., 'inner.layers.0.self_attn.v_proj', op]
        inits[w].name = n.input[1] = f"{module}.weight_kn"
        renamed += 1
    return renamed


def weight_table(path: Path) -> dict:
    """What the runtime needs to know of a graph's weights without parsing it (GraphSpec.data_files, mapped_weights,
    prepacked): its external-data files, the external initializers it may map and share between sessions — not the
    4-bit ones (packed two per byte, no numpy dtype: ORT reads those itself), not the MatMulNBits inputs (their CPU
    kernel computes from its own prepacked copy) — and whether it has MatMulNBits nodes; load_only_weights: the
    MatMulNBits scales and zero points (GraphSpec.load_only_weights)."""
    model = onnx.load(str(path), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    prepacked = {name for n in nbits for name in n.input[1:]}
    load_only = {name for n in nbits for name in n.input[2:4]}  # scales, zero points
    files, mapped, kept = set(), [], []
    for init in model.graph.initializer:
        if not external_data_helper.uses_external_data(init):
            continue
        info = {e.key: e.value for e in init.external_data}
        files.add(info["location"])
        if init.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) or (init.name in prepacked) > (init.name in load_only):
            continue
        (kept if init.name in load_only else mapped).append(
            {"name": init.name, "file": info["location"], "offset": int(info.get("offset", 0)), "length": int(info["length"]),
             "dtype": onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name, "shape": [int(d) for d in init.dims]})
    return {"data_files": sorted(files), "mapped_weights": mapped, "prepacked": bool(prepacked), "load_only_weights": kept}


def _content_key(raw: bytes, data_type: int, dims) -> str:
    return hashlib.sha256(raw + repr((data_type, tuple(dims))).encode()).hexdigest()


def _file_content_key(path: Path, offset: int, length: int, data_type: int, dims, chunk: int = 64 << 20) -> str:
    """_content_key of the bytes at path[offset:offset + length], read a chunk at a time (a token table of GBs is
    never in memory whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            block = f.read(min(chunk, left))
            if not block:
                raise OSError(f"{path} ends before its data")
            h.update(block)
            left -= len(block)
    h.update(repr((data_type, tuple(dims))).encode())
    return h.hexdigest()


def npy_tensors(folder: Path, files: list[str]) -> dict[str, tuple[str, int, int]]:
    """The arrays of .npy files in folder as share_weights' known tensors: content key -> (file, data offset,
    length). (The host's int8 embedding table and its row scales: a tied lm head's re-scored rows are those bytes.)"""
    known = {}
    for name in files:
        path = folder / name
        if not path.exists():
            continue
        arr = np.load(path, mmap_mode="r")  # (the header: shape, dtype, where the data starts)
        if not arr.flags.c_contiguous or arr.offset % 64:  # (np.save aligns the data to 64 bytes)
            continue
        key = _file_content_key(path, arr.offset, arr.nbytes, onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)
        known[key] = (name, arr.offset, arr.nbytes)
        del arr
    return known


def share_weights(folder: Path, graph_files: list[str], data_file: str, min_bytes: int = 1024,
                  known: dict[str, tuple[str, int, int]] | None = None) -> None:
    """Rewrite the graphs so that all initializers >= min_bytes live once in folder/data_file.

    Identical tensors (same bytes, dtype and shape) across graphs are stored once; graphs'
    own .data files are removed afterwards. known (npy_tensors): tensors already in other files of the folder;
    an initializer equal to one of them reads it there instead (a tied lm head's re-scored int8 rows: embed.npy).
    """
    folder = Path(folder)
    known = known or {}
    offsets: dict[str, tuple[int, int]] = {}  # content key -> (offset, length)
    old_data: set[Path] = set()
    with open(folder / data_file, "wb") as out:
        for name in graph_files:
            path = folder / name
            model = onnx.load(str(path), load_external_data=False)
            for init in model.graph.initializer:
                if external_data_helper.uses_external_data(init):
                    info = {e.key: e.value for e in init.external_data}
                    src = folder / info["location"]
                    old_data.add(src)
                    with open(src, "rb") as f:
                        f.seek(int(info.get("offset", 0)))
                        raw = f.read(int(info["length"]))
                else:
                    # raw_data is the stored layout (4-bit tensors packed two per byte); to_array would unpack them
                    if init.HasField("raw_data"):
                        raw = init.raw_data
                    elif init.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
                        continue  # typed-field 4-bit data: left in the graph
                    else:
                        raw = onnx.numpy_helper.to_array(init).tobytes()
                    if len(raw) < min_bytes:
                        continue
                key = _content_key(raw, init.data_type, init.dims)
                if key in known:
                    location, off, length = known[key]
                else:
                    if key not in offsets:
                        pad = (-out.tell()) % 64  # keep tensors aligned for mmap
                        out.write(b"\0" * pad)
                        offsets[key] = (out.tell(), len(raw))
                        out.write(raw)
                    location, (off, length) = data_file, offsets[key]
                init.ClearField("raw_data")
                for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                    init.ClearField(f)
                del init.external_data[:]
                init.data_location = onnx.TensorProto.EXTERNAL
                for k, v in (("location", location), ("offset", str(off)), ("length", str(length))):
                    init.external_data.add(key=k, value=v)
            onnx.save(model, str(path))
    for p in old_data:
        if p.name != data_file and p.exists():
            os.remove(p)
