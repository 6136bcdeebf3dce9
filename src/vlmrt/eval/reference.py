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
from ..manifest import Manifest
from ..runtime.bundle import Bundle


class TorchVision:
    def __init__(self, module, out_name: str):
        self.module, self.out_name = module, out_name

    def run(self, names, feeds):
        (x,) = feeds.values()
        with torch.no_grad():
            return [self.module(torch.from_numpy(np.asarray(x, np.float32))).numpy()]


class TorchDecoder:
    """run(names, feeds) over layers.CausalDecoder, feeds keyed by the manifest's tensor names."""

    def __init__(self, module, m: Manifest):
        if m.kv.layout == "in_place":  # the same weights with the GroupQueryAttention contract (families/gqa.py)
            module = module.with_options(copy_free=True, logit_rows=True, rope_positions=m.kv.max_context, in_place=True)
        self.module, self.m = module, m
        kv = m.kv
        self.past = [n.format(layer=i) for i in range(kv.layers) for n in (kv.key_input, kv.value_input)]
        self.outs = [m.decoder.logits_output] + [n.format(layer=i) for i in range(kv.layers) for n in (kv.key_output, kv.value_output)]
        self.outs += [m.decoder.argmax_output] if m.decoder.argmax_output else []

    def run(self, names, feeds):
        d = self.m.decoder
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()}
        in_place = self.m.kv.layout == "in_place"
        step = (t[d.seqlens_input], t[d.total_length_input]) if in_place else (t[d.positions_input], t[d.mask_input].float())
        rows = [t[d.logit_rows_input]] if in_place else []  # (the in_place module returns those rows itself)
        embeds = t[d.embeds_input].float()
        if d.token_rows_input:  # the graph's own addition of the int8 rows (export/graphs.py TokenRows)
            embeds = embeds + t[d.token_rows_input].float() * t[d.token_scales_input][:, None]
        with torch.no_grad():
            out = self.module(embeds, *step, *[t[n].float() for n in self.past], *rows)
        by_name = dict(zip(self.outs, (o.numpy() for o in out)))
        if d.logit_rows_input and not in_place:  # the rows the exported graph would return (this module computes all)
            by_name[d.logits_output] = by_name[d.logits_output][feeds[d.logit_rows_input]]
        return [by_name[n] for n in names]


def torch_bundle(ckpt_path: Path, m: Manifest, tokenizer) -> Bundle:
    ckpt = Checkpoint.open(Path(ckpt_path))
    family = family_for(ckpt.config)
    vision, decoder, embed = family.weights(family.config(ckpt.config), ckpt.tensors())
    dec = TorchDecoder(decoder.float(), m)
    sessions = {"vision": TorchVision(vision.float(), m.vision.embeds_output), "prefill": dec, "decode": dec}
    return Bundle(Path(ckpt_path), m, sessions, tokenizer, embed.numpy().astype(np.float32))
