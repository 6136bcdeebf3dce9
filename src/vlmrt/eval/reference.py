"""The float reference as a bundle: vlmrt's torch modules behind the session interface.

`vlmrt eval --reference CKPT` runs the checkpoint through the same family modules the exporter
traces (verified against transformers in tests), in fp32, with the evaluated bundle's host plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..families.checkpoint import Checkpoint
from ..families import family_for
from ..format.manifest import Manifest
from ..runtime.bundle import Bundle


class TorchVision:
    """run(names, feeds) over the vision module: its inputs in the graph's order (the patch rows, then
    vision.extra_inputs), its outputs (the embeddings, then vision.row_outputs) by name."""

    def __init__(self, module, m: Manifest):
        v = m.vision
        self.module, self.inputs, self.outputs = module, [v.patches_input, *v.extra_inputs.values()], [
            v.embeds_output, *v.row_outputs]

    def run(self, names, feeds):
        x = [torch.from_numpy(np.asarray(feeds[n])) for n in self.inputs]
        with torch.no_grad():
            out = self.module(*(t.float() if t.is_floating_point() else t for t in x))
        by_name = dict(zip(self.outputs, (o.numpy() for o in (out if isinstance(out, tuple) else (out,)))))
        return [by_name[n] for n in names]


class TorchAttention(NamedTuple):
    """How the torch modules compute what a decoder kind's graph does: the attention kind (families/layers.py
    ATTENTION_KINDS), and whether the module takes the kind's logit_rows input itself (CausalDecoder.logit_rows: it
    returns those rows' logits only) or returns every row's, of which run() keeps the graph's rows."""

    attention: str
    gathers_rows: bool


# by decoder kind (manifest.DECODER_KINDS)
TORCH_ATTENTION = {"gqa_in_place": TorchAttention("gqa_in_place", True),
                   "rows_dynamic": TorchAttention("rows_copy_free", False),
                   "rows_static": TorchAttention("rows_copy_free", False)}


class TorchDecoder:
    """run(names, feeds) over layers.CausalDecoder, feeds keyed by the manifest's tensor names."""

    def __init__(self, module, m: Manifest):
        torch_attention, self.parts = TORCH_ATTENTION[m.decoder.kind.name], m.decoder.kind.parts()
        # the same weights with the kind's attention
        module = module.with_options(attention=torch_attention.attention, logit_rows=torch_attention.gathers_rows,
                                     rope_positions=m.kv.max_context + m.decoder.prefill_ar)
        module.valid_rows = bool(self.parts.valid_rows_input)  # (a static graph's padding kept out of its state)
        # (a windowed cache's buffers: the capacity the bundle's sliding layers have, as export_decoder sets it)
        module.window_capacity = m.kv.window_capacity()
        self.module, self.m = module, m
        self.step = list(self.parts.step_inputs)
        self.past = m.kv.state_inputs()
        self.outs = [m.decoder.logits_output, *m.kv.state_outputs()]
        self.outs += [self.parts.argmax_output] if self.parts.argmax_output else []

    def run(self, names, feeds):
        d, k = self.m.decoder, self.parts
        t = {n: torch.from_numpy(np.asarray(v)) for n, v in feeds.items()}
        step = [t[n].float() if t[n].is_floating_point() else t[n] for n in self.step]
        rows = [t[k.logit_rows_input]] if self.module.logit_rows else []
        embeds = t[d.embeds_input].float()
        if k.token_rows_input:  # the graph's own addition of the int8 rows (export/graphs.py TokenRows)
            embeds = embeds + t[k.token_rows_input].float() * t[k.token_scales_input][:, None]
        row_input = [t[d.row_input.input].float()] if d.row_input else []
        row_input += [t[d.span_input]] if d.span_input else []
        valid = [t[k.valid_rows_input].float()] if k.valid_rows_input else []
        with torch.no_grad():
            out = self.module(embeds, t[d.positions.input], *row_input, *step, *[t[n].float() for n in self.past], *rows,
                              *valid)
        by_name = dict(zip(self.outs, (o.numpy() for o in out)))
        if k.logit_rows_input and not self.module.logit_rows:
            by_name[d.logits_output] = by_name[d.logits_output][feeds[k.logit_rows_input]]  # the graph's rows only
        return [by_name[n] for n in names]


def torch_bundle(ckpt_path: Path, m: Manifest, tokenizer) -> Bundle:
    ckpt = Checkpoint.open(Path(ckpt_path))
    family = family_for(ckpt.config)
    vision, decoder, embed = family.weights(family.config(ckpt.config), ckpt.tensors())
    dec = TorchDecoder(decoder.float(), m)
    sessions = {"vision": TorchVision(vision.float(), m), "prefill": dec, "decode": dec}
    return Bundle(Path(ckpt_path), m, sessions, tokenizer, embed.rows(0, embed.shape[0]))
