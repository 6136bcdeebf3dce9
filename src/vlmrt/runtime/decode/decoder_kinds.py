"""How each kind of decoder graph steps: one strategy object per manifest `decoder.kind`, registered by name.

    kind = decoder_kind(manifest.decoder, manifest.kv)    # DECODER_KINDS[decoder.kind.name](...)
    cache = KVCache(manifest.kv, kind.layout, ...)        # the state kinds' buffers laid out as this kind's graphs take them
    kind.graph("prefill"), kind.ar("prefill", n)           # which graph a step of n rows calls, at which AR
    kind.context(slot)                                     # the cache prefix [:ctx] a step at that slot reads
    inputs = kind.step_inputs(ar, ctx, dtype_of)           # the kind's own step part (a mask, or the step's end slot)
    kind.output, kind.features                             # the step parts the manifest names (step_features.py)
    kind.store(cache, staged, n, positions)                # the step's rows into the cache (KVCache.store)

Every kind takes inputs_embeds and the rope positions [rows, ar] (computed by the host, runtime/prompt/positions.py),
apart from the slots its rows go to; runtime/decode/step.py owns what all kinds share (the step's buffers, the call), the
parts (step_features.py) what the manifest's optional parts add, the state kinds (state_kinds.py) how each layer's
state is bound and written in the kind's layout.
  gqa_in_place  the CPU one-graph decoder: GroupQueryAttention updates the HEADS buffers itself, given the step's
                end slot (seqlens_k, total_sequence_length); the host writes nothing but the length (and a conv
                layer's rows, which the graph returns as the rows kinds' do)
  rows_dynamic  one graph, symbolic AR and cache length, the rows contract (mask from slots, new rows out)
  rows_static   fixed-AR graphs (prefill / decode / verify), the rows contract, a padded last prompt block
"""

from __future__ import annotations

import numpy as np

from ...format.manifest import DecoderSpec, KVSpec
from .kv_cache import HEADS, ROWS, KVCache, context_slots
from .step_features import EndSlot, EndSlots, StepMask, decoder_features

DECODER_KINDS: dict[str, type] = {}


def register_kind(cls: type) -> type:
    DECODER_KINDS[cls.name] = cls
    return cls


def decoder_kind(dec: DecoderSpec, kv: KVSpec):
    return DECODER_KINDS[dec.kind.name](dec, kv)


class _Kind:
    """What the kinds share; each subclass sets `name` and `layout` and decides its graphs' AR and cache reads."""

    name = ""
    layout = ROWS

    def __init__(self, dec: DecoderSpec, kv: KVSpec):
        self.dec, self.spec, self.kv = dec, dec.kind, kv
        self.parts = parts = dec.kind.parts()  # the kind's optional parts, explicit (manifest.KindParts)
        self.output, self.features = decoder_features(dec, parts)  # the step parts they make (step_features.py)
        # what the scheduler and the cache rows ask of them
        self.argmax_output, self.token_rows_input = parts.argmax_output, parts.token_rows_input
        self.hidden_output, self.verify_ar = parts.hidden_output, parts.verify_ar

    def context(self, slot: int) -> int:
        """The cache prefix [:ctx] a step whose first row goes to slot reads (it holds slots 0..slot-1)."""
        return self.kv.max_context

    def cache_length(self) -> int | None:
        """The cache length the decoder graphs' cache inputs have (None: symbolic): runtime/bundle.py checks them."""
        return self.kv.max_context

    def logits_rows(self, ar: int, all_rows: bool = False) -> int:
        """How many (last) rows' logits a step of AR tokens returns: all_rows (a lookahead verify step) needs
        logit_rows_input or a static graph; else 1 with logit_rows_input or a head graph, ar for a static graph."""
        p = self.parts
        if all_rows:
            if p.hidden_output:  # (a head graph maps one row)
                raise ValueError("this decoder graph cannot return the logits of every row")
            return ar
        return 1 if p.logit_rows_input or p.hidden_output else ar

    def check_lookahead(self, k: int) -> None:
        """A draft length k the decoder can verify (ValueError if not)."""
        p = self.parts
        if k < 0:
            raise ValueError("--lookahead must be >= 0")
        if k and not (p.logit_rows_input or p.verify_ar):
            raise ValueError("this bundle's decoder graphs cannot verify lookahead drafts (no verify graph); re-export "
                             "it with export --target htp --lookahead-ar K (a static verify graph of K tokens)")
        ar, what = (p.verify_ar, "verify graph") if p.verify_ar else (self.dec.prefill_ar, "graph")
        if k >= ar:
            raise ValueError(f"--lookahead is at most {ar - 1} for this bundle (its {what}'s AR is {ar})")

    def check_positions(self, positions: np.ndarray, slot: int) -> None:
        """Positions the graphs can take for a step at slot (ValueError if not)."""

    def prompt_block(self, kernel_rows: int | None) -> int:
        """The prompt block to run, given the most rows a call of the attention kernel should take (kernel_rows;
        Sessions.prefill_rows): the manifest's, where attention is not on GroupQueryAttention or the AR is fixed."""
        return self.dec.prefill_ar

    def batch_inputs(self, batch: int):
        """The step inputs of one call that advances `batch` sequences one token each; ValueError where the graph
        takes one sequence per call (the rows kinds: the NPU's static graphs stay one sequence per call)."""
        raise ValueError(f"decoder kind {self.name} takes one sequence per call")

    def bound_for_short_blocks(self) -> bool:
        """Whether a prompt's short last block (of a symbolic-AR graph) runs as a bound step made for it (else a
        plain session.run)."""
        return False

    def store(self, cache: KVCache, staged: list[np.ndarray], n: int, positions: np.ndarray) -> None:
        """The first n rows of a step (and their positions [rows, ar]) into the cache: KVCache.store."""
        cache.store(staged, n, positions)


class _Rows(_Kind):
    """The rows contract: a mask from slots, the step's new rows out, written by the host."""

    def step_inputs(self, ar: int, ctx: int, dtype_of) -> StepMask:
        """dtype_of(input name): the graph's dtype of an input."""
        return StepMask(self.spec.mask_input, ar, ctx, dtype_of(self.spec.mask_input), self.mask_value())

    def mask_value(self) -> float | None:
        """The mask's value at hidden slots (None: the dtype's lowest)."""
        return None

    def context(self, slot: int) -> int:
        step, top = self.spec.context_step, self.kv.max_context
        return context_slots(slot, step, top) if step else top

    def cache_length(self) -> int | None:
        return None if self.spec.context_step else self.kv.max_context


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
        ar = {"prefill": self.dec.prefill_ar, "verify": self.verify_ar}.get(purpose, 1)
        if n > ar and purpose != "decode":  # (a span longer than the prefill AR: the export keeps them within it)
            raise ValueError(f"a {purpose} step of {n} rows is longer than the static {purpose} graph's AR {ar}")
        return ar

    def mask_value(self) -> float | None:
        return self.spec.mask_value  # (quantized HTP graphs: a moderate value)

    def store(self, cache: KVCache, staged: list[np.ndarray], n: int, positions: np.ndarray) -> None:
        """With valid_rows_input the graph kept a state that is not per slot at the step's last real row: the step is
        n rows long for such a state (a padded block's padding never entered it)."""
        cache.store(staged, n, positions[:, :n] if self.parts.valid_rows_input else positions)


@register_kind
class GqaInPlace(_SymbolicAR, _Kind):
    name = "gqa_in_place"
    layout = HEADS

    def step_inputs(self, ar: int, ctx: int, dtype_of) -> EndSlot:
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

    def prompt_block(self, kernel_rows: int | None) -> int:
        # (any AR up to the bundle's block: a smaller block is another shape of the same graph)
        return self.dec.prefill_ar if kernel_rows is None else min(self.dec.prefill_ar, kernel_rows)

    def batch_inputs(self, batch: int) -> EndSlots:
        """The step inputs of one call advancing `batch` sequences by one token each (decoder.kind.batched)."""
        if not self.parts.batched:
            raise ValueError("this bundle's decoder graph takes one sequence per call; re-export it with this vlmrt "
                             "to decode several sequences in one call")
        return EndSlots(self.spec.seqlens_input, self.spec.total_length_input, batch)
