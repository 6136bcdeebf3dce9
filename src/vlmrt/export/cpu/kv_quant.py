"""The CPU decoder's quantized KV cache (`vlmrt export --kv-cache int8|int4`): ORT's GroupQueryAttention stores each
layer's K and V symmetrically quantized (CPU kernels for AVX2 and AVX512-VNNI) and reads them back scaled.

    absmax, rows = calibrate(decoder, embed, prompt_ids)    # per attention layer: |K|, |V| max per channel
    quants = scales(absmax, rows, bits)                      # manifest.CacheQuant per attention layer
    quantize_cache(model, quants)                            # each GroupQueryAttention node takes them

The scales are calibrated once, at export, on the float decoder over the calibration prompts GPTQ uses (each
followed by the decoder's own greedy answer), absmax × HEADROOM per channel of the post-RoPE keys and the values.
They are constants of the graph, so every path (prefix reuse, multi-turn, a batch's rows, lookahead drafts and
their rollback, server slots) reads and writes one encoding: scales set per prompt at the end of its prefill could
not be shared by a batch's rows (one node, one scale) nor by a kept prefix of another prompt.
What ORT 1.32 takes (probed with a one-node graph): attributes kv_cache_bit_width 8 | 4, k_quant_type / v_quant_type
PER_TENSOR | PER_CHANNEL; inputs 12, 13 k_scale / v_scale float32 ([] per tensor, [kv_heads, 1, head_dim] per
channel); past / present int8 [B, kv_heads, max, head_dim] at 8 bits, uint8 [.., head_dim / 2] at 4 (two values a
byte); q = clamp(round(x / scale)), [-128, 127] or [-8, 7]; past and present bound to one buffer (in place) work.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...format.manifest import AttentionLayer, CacheQuant

KV_CACHES = {"fp32": 0, "int8": 8, "int4": 4}  # --kv-cache -> bits (0: the float cache)
LEVELS = {8: 127, 4: 7}  # the largest quantized magnitude
HEADROOM = {8: 1.25, 4: 1.0}  # absmax multiplier: room for rows beyond the calibration's (int4: resolution first)
# a channel's scale is at least this share of its layer's largest (K or V): the short calibration prompts leave some
# channels a range that longer text exceeds up to 6x (SmolLM2, docs/*.md at 1000 tokens: 0.6 % of K values clipped,
# row error p99 14 %); with the floor the K rows' error is 1.2 % mean, 1.8 % p99 (docs/performance.md)
FLOOR = 0.5
MIN_ROWS = 256  # fewer calibration rows (tokens) than this: the scales are refused as unstable
STORAGE = {8: TensorProto.INT8, 4: TensorProto.UINT8}
ROWS_STEP = ("attention_mask",)  # the step inputs of the rows kinds, which the float steps below take


class KVQuantError(ValueError):
    pass


def calibrate(decoder, embed: np.ndarray, prompt_ids: list[list[int]], tokens: int) -> tuple[list[np.ndarray], int]:
    """absmax [2 (K, V), kv_heads * head_dim] of each attention layer's rows (post-RoPE keys, values) over the
    prompts followed by `tokens` greedy tokens of the float decoder; and the number of rows seen."""
    import torch

    from ..cache_kinds import CACHE_KINDS
    from .calibrate_gptq import _step, empty_state, greedy_sequence

    decoder = decoder.float().eval()
    if decoder.attention.step_inputs != ROWS_STEP:  # (Gemma 4's module is built as the CPU's gqa_in_place graph: the
        # same weights as a rows-kind decoder, whose sliding layers keep their rows by slot, the window in the mask)
        decoder = decoder.with_options(attention="rows_copy_free", logit_rows=False,
                                       rope_positions=max(map(len, prompt_ids)) + tokens)
    absmax: list[np.ndarray] = []
    rows = 0
    with torch.no_grad():
        for ids in prompt_ids:
            seq = torch.from_numpy(greedy_sequence(decoder, embed, ids, tokens))
            n = len(seq)
            mask = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
            _, *new = _step(decoder, seq, 0, mask, empty_state(decoder))
            at, layer = 0, 0
            for kind in decoder.layer_kinds:
                try:
                    m = CACHE_KINDS[kind].absmax(new[at:at + CACHE_KINDS[kind].tensors])
                except NotImplementedError as e:  # (a kind the quantized cache does not hold)
                    raise KVQuantError(str(e)) from None
                at += CACHE_KINDS[kind].tensors
                if m is None:  # (a state the quantized cache does not hold)
                    continue
                if layer == len(absmax):
                    absmax.append(m)
                absmax[layer] = np.maximum(absmax[layer], m)
                layer += 1
            rows += n
    return absmax, rows


def scales(absmax: list[np.ndarray], rows: int, bits: int, key: str = "per_channel",
           value: str = "per_channel") -> list[CacheQuant]:
    """Each attention layer's CacheQuant from its calibrated absmax (calibrate): scale = max(absmax, FLOOR × the
    layer's largest) × HEADROOM / LEVELS per channel (K and V apart), or the layer's largest per tensor."""
    if rows < MIN_ROWS:
        raise KVQuantError(f"the KV cache calibration saw {rows} rows (tokens), fewer than the {MIN_ROWS} stable "
                           "scales need: give more calibration prompts")
    out = []
    for m in absmax:
        m = m.astype(np.float64)
        s = np.maximum(np.maximum(m, FLOOR * m.max(-1, keepdims=True)), 1e-6) * HEADROOM[bits] / LEVELS[bits]
        k, v = ([_short(y) for y in x] if kind == "per_channel" else [_short(x.max())]
                for x, kind in ((s[0], key), (s[1], value)))
        out.append(CacheQuant(bits=bits, key=key, value=value, key_scale=k, value_scale=v, headroom=HEADROOM[bits],
                              calibration_rows=rows))
    return out


def _short(x) -> float:
    """A scale to 6 significant digits: what the manifest lists and the graph holds (as float32), the same value."""
    return float(f"{float(x):.6g}")


def _scale_tensor(name: str, scale: list[float], kind: str, kv_heads: int, head_dim: int) -> onnx.TensorProto:
    a = np.asarray(scale, np.float32)
    return numpy_helper.from_array(a.reshape(kv_heads, 1, head_dim) if kind == "per_channel" else a.reshape(()), name)


def quantize_cache(model: onnx.ModelProto, layers: list[AttentionLayer]) -> int:
    """Each GroupQueryAttention node stores the cache of the attention layer whose K buffer it reads (its past_key:
    the layer's key_input, or a Pad of it, as a span graph's second node of a windowed layer reads it: export/gqa_onnx.py
    _windowed_spans) quantized as that layer's quant says: its attributes, its k_scale / v_scale inputs (initializers,
    one pair per layer: a kv-shared layer's node, which reads its source's buffers, takes the source's), the cache
    tensors it reads and writes int8 / uint8 (past_* inputs and present_* outputs of the graph, the Pad between).
    layers: the quantized attention layers (manifest entries with their quant), in kv.layers order; a node reading
    another graph input (a layer whose cache stays float) is left as it is. Returns the nodes changed."""
    g = model.graph
    by_key = {layer.key_input: (i, layer) for i, layer in enumerate(layers)}
    producers = {o: n for n in g.node for o in n.output}
    graph_inputs = {i.name for i in g.input}
    io: dict[str, list] = {}
    for vi in [*g.input, *g.output, *g.value_info]:
        io.setdefault(vi.name, []).append(vi)
    done, seen = 0, set()
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            continue
        past, between = node.input[3], []
        while past in producers and producers[past].op_type == "Pad":
            between.append(past)
            past = producers[past].input[0]
        if past not in by_key and past in graph_inputs:  # a float layer's buffers (no quant): the node keeps them
            continue
        if past not in by_key:
            raise KVQuantError(f"GroupQueryAttention {node.name or '?'} reads {past!r}, no quantized attention layer's "
                               "cache")
        i, layer = by_key[past]
        q = layer.quant
        names = (f"k_scale_{i}", f"v_scale_{i}")
        if i not in seen:
            g.initializer.extend([_scale_tensor(names[0], q.key_scale, q.key, layer.kv_heads, layer.head_dim),
                                  _scale_tensor(names[1], q.value_scale, q.value, layer.kv_heads, layer.head_dim)])
            seen.add(i)
        inputs = list(node.input) + [""] * (12 - len(node.input))  # 10 attention_bias, 11 head_sink
        del node.input[:]
        node.input.extend([*inputs[:12], *names])
        node.attribute.extend([helper.make_attribute("kv_cache_bit_width", q.bits),
                               helper.make_attribute("k_quant_type", q.key.upper()),
                               helper.make_attribute("v_quant_type", q.value.upper())])
        v_between = []
        past_v = node.input[4]
        while past_v in producers and producers[past_v].op_type == "Pad":
            v_between.append(past_v)
            past_v = producers[past_v].input[0]
        # past / present K and V, and what lies between the buffers and the node
        for t in (node.input[3], node.input[4], node.output[1], node.output[2], *between, *v_between):
            for vi in io.get(t, []):
                tt = vi.type.tensor_type
                tt.elem_type = STORAGE[q.bits]
                if len(tt.shape.dim) == 4:
                    tt.shape.dim[3].dim_value = layer.cache_dim
        done += 1
    if len(seen) != len(layers):
        missing = [layer.key_input for i, layer in enumerate(layers) if i not in seen]
        raise KVQuantError(f"no GroupQueryAttention node reads the cache of {', '.join(missing)}")
    return done
