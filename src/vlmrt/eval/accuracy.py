"""`vlmrt eval --reference`: accuracy of a bundle against the float reference on the same weights.

For each (image, prompt) the reference generates greedily (up to N tokens, stopping at EOS); both
the reference and the bundle are then teacher-forced on that sequence, and we report
  first-token match   argmax of the bundle's first logits == the reference's first token
  top-1 agreement     fraction of positions where both argmaxes agree
  mean KL             KL(reference ‖ bundle) of the next-token distributions, averaged over positions
plus the bundle's size on disk and the process's peak RSS.

The reference is an fp32 bundle folder, or a checkpoint folder run through vlmrt's torch modules
(export extra) — the modules tests/ verify token-for-token against transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import numpy as np

from ..format.manifest import Manifest
from ..runtime.vlm import VLM, peak_rss_mb
from .metrics import compare_logits

def evaluate(bundle: VLM, reference: VLM, samples, *, tokens: int = 32, mode: str = "hybrid") -> dict:
    per = []
    t0 = time.perf_counter()
    for image, prompt in samples:
        p = reference.prompt(prompt, [] if image is None else [image])
        ids, ref = p.ids, reference.decoder_inputs(p)  # embeddings, rope positions, row input
        kw = dict(positions=ref.positions, rows=ref.rows, spans=ref.spans)
        seq = list(reference.scheduler.generate(ref.embeds, mode="hybrid", max_new_tokens=tokens, **kw))
        if not seq:  # the reference answered EOS at once: score that single position
            seq = [int(np.argmax(reference.row.prefill(ref.embeds, "hybrid", **kw)))]
        ref_logits = reference.row.score(ref.embeds, seq, "hybrid", **kw)
        pb = bundle.prompt(prompt, [] if image is None else [image])
        if pb.ids != ids:
            raise ValueError("the bundle and the reference tokenize the prompt differently: not the same model")
        x = bundle.decoder_inputs(pb)
        got = bundle.row.score(x.embeds, seq, mode, positions=x.positions, rows=x.rows, spans=x.spans)
        r = compare_logits(ref_logits, got)
        r.update(image=str(image) if image else None, prompt=prompt, prompt_tokens=len(ids),
                 reference_text=reference.bundle.tokenizer.decode(seq, skip_special_tokens=True))
        per.append(r)
    positions = sum(r["positions"] for r in per)
    m = bundle.manifest
    return {
        "bundle": str(bundle.bundle.path),
        "precision": {k: g.precision for k, g in m.graphs.items()},
        "lm_head": m.graphs["decode"].weights.get("lm_head"),
        "mode": mode,
        "samples": len(per),
        "positions": positions,
        "first_token_match": sum(r["first_token_match"] for r in per) / len(per),
        "top1_agreement": sum(r["agree_count"] for r in per) / positions,
        "mean_kl": sum(r["kl_sum"] for r in per) / positions,
        "bundle_bytes": sum(e["bytes"] for e in m.files.values()),
        "peak_rss_mb": peak_rss_mb(),
        "eval_s": time.perf_counter() - t0,
        "per_sample": per,
    }


def float_manifest(m: Manifest) -> Manifest:
    """The same host plan with float32 graph I/O and KV cache (for a float reference)."""
    m = copy.deepcopy(m)
    m.kv = dataclasses.replace(m.kv, dtype="float32", encodings={})
    if m.decoder.kind.parts().hidden_output:  # the reference's decoder returns logits itself (a rows_static kind's)
        m.decoder = dataclasses.replace(m.decoder, kind=dataclasses.replace(m.decoder.kind, hidden_output=None))
    m.graphs.pop("head", None)
    for g in m.graphs.values():
        for t in g.inputs + g.outputs:
            if t.dtype in ("float16", "uint8", "uint16", "int8"):
                t.dtype = "float32"
    return m


def load_reference(ref: str | Path, bundle: VLM) -> VLM:
    """An fp32 bundle folder, or a checkpoint folder run through vlmrt's torch modules."""
    ref = Path(ref)
    if (ref / "manifest.json").is_file():
        return VLM.load(ref)
    if not (ref / "config.json").is_file():
        raise ValueError(f"reference {ref} is neither a bundle nor a checkpoint folder")
    from .reference import torch_bundle

    return VLM(torch_bundle(ref, float_manifest(bundle.manifest), bundle.bundle.tokenizer))
