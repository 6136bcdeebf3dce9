"""The float reference as a bundle: vlmrt's torch modules behind the session interface.

`vlmrt eval --reference CKPT` runs the checkpoint through the same family modules the exporter
traces (verified against transformers in tests), in fp32, with the evaluated bundle's host plan.
"""

from __future__ import annotations

from pathlib import Path

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


# the torch attention kind (families/layers.py ATTENTION_KINDS) that computes what each decoder kind's graph does
ATTENTION_OF_KIND = {"gqa_in_place": "gqa_in_place", "rows_dynamic": "rows_copy_free", "rows_static": "rows_copy_free"}


class TorchDecoder:
    """run(names, feeds) over layers.CausalDecoder, feeds keyed by the manifest's tensor names."""

    def __init__(self, module, m: Manifest):
        k = m.decoder.kind
        attention = ATTENTION_OF_KIND[k.name]
        # the same weights with the kind's attention; gqa_in_place's module returns logit_rows' rows itself
        module = module.with_options(attention=attention, logit_rows=attention == "gqa_in_place",
                                     rope_positions=m.kv.max_context + m.decoder.prefill_ar)
        self.module, self.m = module, m
        self.step = [t for t in (getattr(k, f, None) for f in ("mask_input", "seqlens_input", "total_length_input")) if t]
        self.past = m.kv.state_inputs()
        self.outs = [m.decoder.logits_output, *m.kv.state_outputs()]
        self.outs += [k.argmax_output] if getattr(k, "argmax_output", None) else []

    def run(self, names, feeds):
        d, k = self.m.decoder, self.m.decoder.kind
        t = {n: torch.from_numpy(np.asarray(v)) for n, v in feeds.items()}
        step = [t[n].float() if t[n].is_floating_point() else t[n] for n in self.step]
        rows = [t[k.logit_rows_input]] if self.module.logit_rows else []
        embeds = t[d.embeds_input].float()
        if getattr(k, "token_rows_input", None):  # the graph's own addition of the int8 rows (export/graphs.py TokenRows)
            embeds = embeds + t[k.token_rows_input].float() * t[k.token_scales_input][:, None]
        row_input = [t[d.row_input.input].float()] if d.row_input else []
        with torch.no_grad():
            out = self.module(embeds, t[d.positions.input], *row_input, *step, *[t[n].float() for n in self.past], *rows)
        by_name = dict(zip(self.outs, (o.numpy() for o in out)))
        if getattr(k, "logit_rows_input", None) and not self.module.logit_rows:
            by_name[d.logits_output] = by_name[d.logits_output][feeds[k.logit_rows_input]]  # the graph's rows only
        return [by_name[n] for n in names]


def torch_bundle(ckpt_path: Path, m: Manifest, tokenizer) -> Bundle:
    ckpt = Checkpoint.open(Path(ckpt_path))
    family = family_for(ckpt.config)
    vision, decoder, embed = family.weights(family.config(ckpt.config), ckpt.tensors())
    dec = TorchDecoder(decoder.float(), m)
    sessions = {"vision": TorchVision(vision.float(), m), "prefill": dec, "decode": dec}
    return Bundle(Path(ckpt_path), m, sessions, tokenizer, embed.numpy().astype(np.float32))
