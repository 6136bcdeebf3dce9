"""How each kind of decoder graph steps: one strategy object per manifest `decoder.kind`, registered by name.

    kind = decoder_kind(manifest.decoder, manifest.kv)    # DECODER_KINDS[decoder.kind.name](...)
    cache = KVCache(manifest.kv, kind.layout, ...)        # the buffers laid out as this kind's graphs take them
    kind.graph("prefill"), kind.ar("prefill", n)           # which graph a step of n rows calls, at which AR
    kind.context(slot)                                     # the cache prefix [:ctx] a step at that slot reads
    inputs = kind.step_inputs(ar, ctx, dtype)              # the kind's own inputs (a mask, or the step's end slot)
    kind.bind_cache(bind, cache, ctx, staged)              # the cache as a bound step's inputs / outputs
    kind.store(cache, staged, n, positions)                # the step's rows into the cache (or only the length)

Every kind takes inputs_embeds and the rope positions [rows, ar] (computed by the host, runtime/positions.py),
apart from the slots its rows go to; runtime/step.py owns what all kinds share (the step's buffers, the call).
  gqa_in_place  the CPU one-graph decoder: GroupQueryAttention updates the HEADS buffers itself, given the step's
                end slot (seqlens_k, total_sequence_length); the host writes nothing but the length (and a conv
                layer's rows, which the graph returns as the rows kinds' do)
  rows_dynamic  one graph, symbolic AR and cache length, the rows contract (mask from slots, new rows out)
  rows_static   fixed-AR graphs (prefill / decode / verify), the rows contract, a padded last prompt block
"""

from __future__ import annotations

import numpy as np

from ..format.manifest import DecoderSpec, KVSpec
from .kv_cache import HEADS, ROWS, KVCache, attention_mask, context_slots

DECODER_KINDS: dict[str, type] = {}


def register_kind(cls: type) -> type:
    DECODER_KINDS[cls.name] = cls
    return cls


def decoder_kind(dec: DecoderSpec, kv: KVSpec):
    return DECODER_KINDS[dec.kind.name](dec, kv)


class StepMask:
    """A rows step's additive mask [ar, ctx + ar] (kv_cache.attention_mask, from slots), kept across calls: a step at a
    later slot than the last only unmasks the slots in between (one slot per decode step), else it is rebuilt."""

    def __init__(self, name: str, ar: int, ctx: int, dtype, neg: float | None):
        self.name = name
        self.array = np.zeros((ar, ctx + ar), dtype)
        self.ar, self.ctx, self.neg = ar, ctx, neg
        self.slot = -1  # the slot the array is for; -1: none yet

    def set(self, slot: int) -> None:
        if 0 <= self.slot <= slot:
            self.array[:, self.slot : slot] = 0  # the cache now also holds slots self.slot..slot-1
        else:
            attention_mask(slot, self.ar, self.ctx, self.array.dtype, out=self.array, neg=self.neg)
        self.slot = slot

    def bind(self, bind) -> None:
        bind(self.name, self.array)

    def feeds(self) -> dict[str, np.ndarray]:
        return {self.name: self.array}


class EndSlot:
    """gqa_in_place's step inputs: seqlens_k [1] int32 = the step's last slot, total_sequence_length [] int32 = that
    + 1 (GroupQueryAttention writes the step's rows at slots total - ar .. total - 1)."""

    def __init__(self, seqlens: str, total: str, ar: int):
        self.names, self.ar = (seqlens, total), ar
        self.seqlens, self.total = np.zeros(1, np.int32), np.zeros((), np.int32)
        # memoryviews: a decode step writes one scalar of each (a plain C store, where a numpy scalar index runs its
        # dtype machinery on caches a graph call left cold)
        self._seqlens, self._total = memoryview(self.seqlens), memoryview(self.total.reshape(1))

    def set(self, slot: int) -> None:
        self._seqlens[0] = slot + self.ar - 1
        self._total[0] = slot + self.ar

    def bind(self, bind) -> None:
        bind(self.names[0], self.seqlens)
        bind(self.names[1], self.total)

    def feeds(self) -> dict[str, np.ndarray]:
        return {self.names[0]: self.seqlens, self.names[1]: self.total}


class EndSlots(EndSlot):
    """A batch's step inputs (decoder.kind.batched): seqlens_k [B] int32 = each sequence's step's last slot,
    total_sequence_length [] int32 = the largest + 1 (runtime/scheduler.py sets them row by row)."""

    def __init__(self, seqlens: str, total: str, batch: int):
        super().__init__(seqlens, total, 1)
        self.seqlens = np.zeros(batch, np.int32)
        self._seqlens = memoryview(self.seqlens)


class _Kind:
    """What the kinds share; each subclass sets `name` and `layout` and decides its graphs' AR and cache reads."""

    name = ""
    layout = ROWS

    def __init__(self, dec: DecoderSpec, kv: KVSpec):
        self.dec, self.spec, self.kv = dec, dec.kind, kv
        self.logit_rows_input = getattr(self.spec, "logit_rows_input", None)
        self.argmax_output = getattr(self.spec, "argmax_output", None)
        self.token_rows_input = getattr(self.spec, "token_rows_input", None)
        self.token_scales_input = getattr(self.spec, "token_scales_input", None)
        self.hidden_output = getattr(self.spec, "hidden_output", None)
        self.verify_ar = getattr(self.spec, "verify_ar", 0)

    def context(self, slot: int) -> int:
        """The cache prefix [:ctx] a step whose first row goes to slot reads (it holds slots 0..slot-1)."""
        return self.kv.max_context

    def logits_rows(self, ar: int, all_rows: bool = False) -> int:
        """How many (last) rows' logits a step of AR tokens returns: all_rows (a lookahead verify step) needs
        logit_rows_input or a static graph; else 1 with logit_rows_input or a head graph, ar for a static graph."""
        if all_rows:
            if self.hidden_output:  # (a head graph maps one row)
                raise ValueError("this decoder graph cannot return the logits of every row")
            return ar
        return 1 if self.logit_rows_input or self.hidden_output else ar

    def check_lookahead(self, k: int) -> None:
        """A draft length k the decoder can verify (ValueError if not)."""
        if k < 0:
            raise ValueError("--lookahead must be >= 0")
        if k and not (self.logit_rows_input or self.verify_ar):
            raise ValueError("this bundle's decoder graphs cannot verify lookahead drafts (no verify graph); re-export "
                             "it with export --target htp --lookahead-ar K (a static verify graph of K tokens)")
        ar, what = (self.verify_ar, "verify graph") if self.verify_ar else (self.dec.prefill_ar, "graph")
        if k >= ar:
            raise ValueError(f"--lookahead is at most {ar - 1} for this bundle (its {what}'s AR is {ar})")

    def check_positions(self, positions: np.ndarray, slot: int) -> None:
        """Positions the graphs can take for a step at slot (ValueError if not)."""

    def batch_inputs(self, batch: int):
        """The step inputs of one call that advances `batch` sequences one token each; ValueError where the graph
        takes one sequence per call (the rows kinds: the NPU's static graphs stay one sequence per call)."""
        raise ValueError(f"decoder kind {self.name} takes one sequence per call")

    def bound_for_short_blocks(self) -> bool:
        """Whether a prompt's short last block (of a symbolic-AR graph) runs as a bound step made for it (else a
        plain session.run)."""
        return False

    # --- the cache at the graph edge ---
    def staging(self, cache: KVCache, ar: int):
        """Where a step's state outputs land before store() (the rows kinds' staging blocks)."""
        return cache.staging(ar)

    def bind_cache(self, bind, bind_output, cache: KVCache, ctx: int, staged) -> None:
        """The cache's buffers as a bound step's inputs (prefixes [:ctx], contiguous: no copy) and its outputs into
        the staging blocks."""
        for name, buf, prefix in cache.inputs():
            bind(name, buf[:ctx] if prefix else buf)
        for name, buf in zip(cache.output_names(), cache.staged_outputs(staged)):
            bind_output(name, buf)

    def take(self, cache: KVCache, staged, outputs: list[np.ndarray], slot: int, ar: int) -> None:
        """A plain step's state outputs (output_names() order) into the staging blocks."""
        for buf, r in zip(cache.staged_outputs(staged), outputs):
            buf[...] = r

    def store(self, cache: KVCache, staged, n: int, positions: np.ndarray) -> None:
        """The first n rows of a step (and their positions [rows, ar]) into the cache: KVCache.write."""
        cache.write(staged, n, positions)


class _Rows(_Kind):
    """The rows contract: a mask from slots, the step's new rows out, written by the host."""

    def step_inputs(self, ar: int, ctx: int, dtype) -> StepMask:
        return StepMask(self.spec.mask_input, ar, ctx, dtype, getattr(self.spec, "mask_value", None))

    def context(self, slot: int) -> int:
        step, top = self.spec.context_step, self.kv.max_context
        return context_slots(slot, step, top) if step else top


class _SymbolicAR:
    """One graph for every step, any AR 1..prefill_ar: a step feeds exactly its rows, never padding."""

    def graph(self, purpose: str) -> str:
        """The graph a step of purpose ("prefill", "decode", "verify") calls."""
        return "decode" if purpose == "verify" else purpose  # (prefill and decode name the same graph file)

    def ar(self, purpose: str, n: int) -> int:
        return n


@register_kind
class RowsDynamic(_SymbolicAR, _Rows):
    name = "rows_dynamic"


@register_kind
class RowsStatic(_Rows):
    name = "rows_static"

    def graph(self, purpose: str) -> str:
        return purpose

    def ar(self, purpose: str, n: int) -> int:  # the last prompt block (and a verify step) padded to the graph's AR
        return {"prefill": self.dec.prefill_ar, "verify": self.verify_ar}.get(purpose, 1)


@register_kind
class GqaInPlace(_SymbolicAR, _Kind):
    name = "gqa_in_place"
    layout = HEADS

    def step_inputs(self, ar: int, ctx: int, dtype) -> EndSlot:
        return EndSlot(self.spec.seqlens_input, self.spec.total_length_input, ar)

    def check_positions(self, positions: np.ndarray, slot: int) -> None:
        # ORT's GroupQueryAttention rotates a step at slot 0 (its "first prompt") by positions[0] + i, whatever the
        # rest; several rope rows (M-RoPE) are gathered in the graph, whose op positions are 0..ar-1 (layers._gqa_rope)
        rows, n = positions.shape
        if rows == 1 and slot == 0 and n > 1 and not np.array_equal(positions[0], positions[0, 0] + np.arange(n)):
            raise ValueError("decoder kind gqa_in_place takes consecutive positions in a step at slot 0 "
                             "(GroupQueryAttention's first prompt); re-export with --attention portable")

    def bound_for_short_blocks(self) -> bool:
        return True  # (a plain call would return copies of the whole buffers)

    def staging(self, cache: KVCache, ar: int):
        return cache.conv_staging(ar) if cache.convs else None  # the graph writes the attention buffers

    def bind_cache(self, bind, bind_output, cache: KVCache, ctx: int, staged) -> None:
        """Each attention buffer bound as input and output (one OrtValue): the graph updates it in place; a conv
        layer's window as input, its new rows into the staging."""
        convs = iter(staged or ())
        for (name, buf, _), out, layer in zip(cache.inputs(), cache.output_names(), _state_layers(cache)):
            if layer.kind == "conv":
                bind(name, buf)
                bind_output(out, next(convs))
            else:
                bind_output(out, bind(name, buf))

    def take(self, cache: KVCache, staged, outputs: list[np.ndarray], slot: int, ar: int) -> None:
        # a plain call returns the whole updated buffers: take the step's slots (a conv layer's rows: its staging)
        convs = iter(staged or ())
        for (_, buf, _), r, layer in zip(cache.inputs(), outputs, _state_layers(cache)):
            if layer.kind == "conv":
                next(convs)[...] = r
            else:
                buf[..., slot : slot + ar, :] = r[..., slot : slot + ar, :]

    def store(self, cache: KVCache, staged, n: int, positions: np.ndarray) -> None:
        if staged:
            cache.write_convs(staged, n)
        cache.advance(n, positions)

    def batch_inputs(self, batch: int) -> EndSlots:
        """The step inputs of one call advancing `batch` sequences by one token each (decoder.kind.batched)."""
        if not getattr(self.spec, "batched", False):
            raise ValueError("this bundle's decoder graph takes one sequence per call; re-export it with this vlmrt "
                             "to decode several sequences in one call")
        return EndSlots(self.spec.seqlens_input, self.spec.total_length_input, batch)


def _state_layers(cache: KVCache) -> list:
    """The kv.layers entry of each state input (an attention layer's twice: K, V), in cache.inputs() order."""
    return [layer for layer in cache.spec.layers for _ in layer.inputs]
