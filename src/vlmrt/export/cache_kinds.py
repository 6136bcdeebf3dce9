"""The decoder layers' cache kinds (manifest.CACHE_LAYER_KINDS, each layer's by families.DecoderModule.layer_kinds) as
the exporter and the GPTQ calibration see them, registered by name: a layer's state tensors in a decoder graph (their
names and example tensors in the graph's cache layout), its manifest entry (kv.layers), whether a batched graph takes
it (export/batch_dim.py), its state in the float decoder the GPTQ calibration runs (empty, after a step), and the
uint8 encodings of its state tensors in an HTP bundle (export/htp: kv.encodings by name). The export and the
calibrations loop over layers and ask the layer's kind: a new cache kind is one class here, no branch there.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..format import manifest as mf


class CacheLayout(NamedTuple):
    """How a decoder graph takes its cache (export/graphs.py LAYOUTS, by attention kind): attention(kv_heads,
    head_dim) -> an example K or V tensor of a layer of that shape and its dynamic dims, the leading dims of a conv
    window ([1] for the in-place graphs' batch), the I/O dtype."""

    attention: Callable[[int, int], tuple[torch.Tensor, dict | None]]
    lead: tuple[int, ...]
    dtype: torch.dtype


class AttentionCache:
    """K and V per layer: rows [ctx, kv_dim] by slot (the rows kinds) or GroupQueryAttention's buffers."""

    name = "attention"
    tensors = 2  # its state tensors (inputs, outputs) per layer
    batchable = True  # (the buffers' first dim is the batch: export/batch_dim.py)
    padded = True  # a static graph's padded rows can be dropped (its state is per slot)

    def names(self, i: int, out_prefix: str) -> tuple[list[str], list[str]]:
        return [f"past_key_{i}", f"past_value_{i}"], [f"{out_prefix}_key_{i}", f"{out_prefix}_value_{i}"]

    def examples(self, decoder, layout: CacheLayout, i: int) -> list[tuple[torch.Tensor, dict | None]]:
        shape = decoder.kv_shape(i)
        return [layout.attention(*shape), layout.attention(*shape)]  # two tensors: the exporter folds one passed twice into one input

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.AttentionLayer:
        return mf.AttentionLayer("attention", *decoder.kv_shape(i), ins[0], ins[1], outs[0], outs[1])

    def encoded(self, layer: mf.AttentionLayer) -> list[tuple[str, str, str]]:
        """(encoding name, cache input, the step's output) of each state tensor (kv.encodings[graph][name][i], i:
        the layer's index among the layers with that name)."""
        return [("key", layer.key_input, layer.key_output), ("value", layer.value_input, layer.value_output)]

    def empty(self, decoder, layer) -> list[torch.Tensor]:
        kv_dim = layer.self_attn.k_proj.out_features
        return [torch.zeros(0, kv_dim), torch.zeros(0, kv_dim)]

    def advance(self, decoder, past: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new K/V rows appended."""
        return [torch.cat([p, r]) for p, r in zip(past, new)]

    def absmax(self, new: list[torch.Tensor]):
        """[2 (K, V), kv_dim] |max| per channel of a step's rows: a quantized cache's calibration (export/cpu/kv_quant.py)."""
        return torch.stack([r.abs().amax(0) for r in new]).numpy()


class ConvCache:
    """A conv layer's window (LFM2's short convolution): the last `width` conv-input rows [width, channels]
    (DecoderModule.conv_state), returned by a step as its own rows new_conv_i (the host writes them by slot)."""

    name = "conv"
    tensors = 1
    batchable = True  # (window [B, width, channels], rows [B, ar / B, channels]: export/batch_dim.py)
    padded = True

    def names(self, i: int, out_prefix: str) -> tuple[list[str], list[str]]:
        return [f"past_conv_{i}"], [f"new_conv_{i}"]  # (the step's rows whatever the attention kind's outputs are)

    def examples(self, decoder, layout: CacheLayout, i: int) -> list[tuple[torch.Tensor, dict | None]]:
        return [(torch.zeros(*layout.lead, *decoder.conv_state, dtype=layout.dtype), None)]  # static: the window's size

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.ConvLayer:
        width, channels = decoder.conv_state
        return mf.ConvLayer("conv", channels=channels, width=width, state_input=ins[0], state_output=outs[0])

    def encoded(self, layer: mf.ConvLayer) -> list[tuple[str, str, str]]:
        return [("conv", layer.state_input, layer.state_output)]

    def empty(self, decoder, layer) -> list[torch.Tensor]:
        return [torch.zeros(*decoder.conv_state)]

    def advance(self, decoder, past: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
        """The window's last `width` rows kept."""
        return [torch.cat([past[0], new[0]])[-decoder.conv_state[0]:]]

    def absmax(self, new: list[torch.Tensor]) -> None:
        """None: a quantized cache holds attention layers only (a conv window stays in the I/O dtype)."""
        return None


class RecurrentCache:
    """A recurrent layer's state (Qwen3.5's Gated DeltaNet): its conv window [width, channels] and the gated delta
    rule's state [heads, key_dim, value_dim] (DecoderModule.recurrent_state), returned by a step as they are after its
    last row (the host keeps them: runtime/decode/recurrent_state.py)."""

    name = "recurrent"
    tensors = 2
    batchable = True  # (both [B, ...]: export/batch_dim.py)
    padded = False  # a static graph's padded rows would be in the state after the step (unless it masks them:
    # export/graphs.py static_valid_rows)

    def names(self, i: int, out_prefix: str) -> tuple[list[str], list[str]]:
        return [f"past_conv_{i}", f"past_state_{i}"], [f"present_conv_{i}", f"present_state_{i}"]

    def examples(self, decoder, layout: CacheLayout, i: int) -> list[tuple[torch.Tensor, dict | None]]:
        width, channels, heads, dk, dv = decoder.recurrent_state
        return [(torch.zeros(*layout.lead, width, channels, dtype=layout.dtype), None),
                (torch.zeros(*layout.lead, heads, dk, dv, dtype=layout.dtype), None)]

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.RecurrentLayer:
        width, channels, heads, dk, dv = decoder.recurrent_state
        return mf.RecurrentLayer("recurrent", width=width, channels=channels, heads=heads, key_dim=dk, value_dim=dv,
                                 conv_input=ins[0], state_input=ins[1], conv_output=outs[0], state_output=outs[1])

    def encoded(self, layer: mf.RecurrentLayer) -> list[tuple[str, str, str]]:
        """None: an HTP bundle keeps the conv window and the state as float graph I/O (16-bit inside its graphs, as
        any activation): both are rewritten whole by every step, so no uint8 rows need one encoding across graphs."""
        return []

    def empty(self, decoder, layer) -> list[torch.Tensor]:
        width, channels, heads, dk, dv = decoder.recurrent_state
        return [torch.zeros(width, channels), torch.zeros(heads, dk, dv)]  # (the rows kinds' layout, no batch dim)

    def advance(self, decoder, past: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
        """The state after the step replaces the old one."""
        return list(new)

    def absmax(self, new: list[torch.Tensor]) -> None:
        """None: a quantized cache holds attention layers only (a recurrent state stays in the I/O dtype)."""
        return None



class SlidingAttentionCache(AttentionCache):
    """A sliding-window layer's K and V (Gemma 4): an attention layer's tensors, its kv.layers entry with the window
    (DecoderModule.window: the keys a query sees; the graph applies it)."""

    name = "sliding_attention"

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.SlidingAttentionLayer:
        return mf.SlidingAttentionLayer("sliding_attention", *decoder.kv_shape(i), ins[0], ins[1], outs[0], outs[1],
                                        window=decoder.window)

    def encoded(self, layer) -> list[tuple[str, str, str]]:
        return [("sliding_key", layer.key_input, layer.key_output), ("sliding_value", layer.value_input, layer.value_output)]


class WindowedAttentionCache(SlidingAttentionCache):
    """A sliding-window layer's K and V in a windowed cache (gqa_in_place graphs: DecoderModule.window_capacity rows
    per buffer, ORT's GroupQueryAttention evicting in the graph: runtime/decode/windowed_state.py): its kv.layers
    entry has the window and the capacity. A quantized cache (--kv-cache int8) calibrates its scales on the float
    decoder's rows by slot, as an attention layer's (absmax)."""

    name = "windowed_attention"
    padded = False  # (no static graph takes it: gqa_in_place only)

    def examples(self, decoder, layout: CacheLayout, i: int) -> list[tuple[torch.Tensor, dict | None]]:
        kv_heads, head_dim = decoder.kv_shape(i)
        return [(torch.zeros(*layout.lead, kv_heads, decoder.window_capacity, head_dim, dtype=layout.dtype), None)
                for _ in range(2)]

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.WindowedAttentionLayer:
        return mf.WindowedAttentionLayer("windowed_attention", *decoder.kv_shape(i), ins[0], ins[1], outs[0], outs[1],
                                         window=decoder.window, capacity=decoder.window_capacity)


class SharedKVCache:
    """A layer that reads an earlier layer's K and V inside the graph (Gemma 4's kv-shared layers): no state tensors;
    its kv.layers entry names the source (DecoderModule.kv_source)."""

    name = "shared_kv"
    tensors = 0
    batchable = True
    padded = True  # (no state: its source's rows are dropped as the source's are)

    def names(self, i: int, out_prefix: str) -> tuple[list[str], list[str]]:
        return [], []

    def examples(self, decoder, layout: CacheLayout, i: int) -> list[tuple[torch.Tensor, dict | None]]:
        return []

    def layer(self, decoder, text, i: int, ins: list[str], outs: list[str]) -> mf.SharedKVLayer:
        return mf.SharedKVLayer("shared_kv", source=decoder.kv_source(i))

    def encoded(self, layer) -> list[tuple[str, str, str]]:
        return []

    def empty(self, decoder, layer) -> list[torch.Tensor]:
        return []

    def advance(self, decoder, past: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
        return []

    def absmax(self, new: list[torch.Tensor]) -> None:
        return None



CACHE_KINDS = {k.name: k for k in (AttentionCache(), ConvCache(), RecurrentCache(), SlidingAttentionCache(),
                                  WindowedAttentionCache(), SharedKVCache())}


def state_names(layer_kinds: tuple[str, ...], out_prefix: str = "new") -> tuple[list[str], list[str]]:
    """A decoder graph's state inputs and outputs, per layer in order (each by its kind's names)."""
    ins, outs = [], []
    for i, kind in enumerate(layer_kinds):
        a, b = CACHE_KINDS[kind].names(i, out_prefix)
        ins, outs = ins + a, outs + b
    return ins, outs


def kv_layers(decoder, text, out_prefix: str) -> list:
    """The manifest's kv.layers: one entry per decoder layer by its cache kind, its tensor names state_names'."""
    return [CACHE_KINDS[kind].layer(decoder, text, i, *CACHE_KINDS[kind].names(i, out_prefix))
            for i, kind in enumerate(decoder.layer_kinds)]


def encoded_edges(layers: list) -> list[tuple[str, int, str, str]]:
    """(encoding name, its index, cache input, the step's output) of every state tensor of the manifest's kv.layers,
    in order: an attention layer's K and V ("key", "value": the i-th attention layer), a conv layer's rows ("conv":
    the i-th conv layer)."""
    out, count = [], {}
    for layer in layers:
        for name, fin, fout in CACHE_KINDS[layer.kind].encoded(layer):
            out.append((name, count.get(name, 0), fin, fout))
            count[name] = count.get(name, 0) + 1
    return out


def padded(layer_kinds) -> bool:
    """Whether static graphs (a prompt's last block padded) can hold these layers: every layer's kind drops padded rows."""
    return all(CACHE_KINDS[k].padded for k in layer_kinds)


def batchable(layer_kinds) -> bool:
    """Whether a gqa_in_place graph of these layers takes a batch (export/batch_dim.py, manifest
    decoder.kind.batched): every layer's kind does."""
    return all(CACHE_KINDS[k].batchable for k in layer_kinds)
