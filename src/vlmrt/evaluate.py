"""`vlmrt eval`: accuracy of a bundle against the float reference on the same weights.

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
from importlib import resources
from pathlib import Path

import numpy as np

from .manifest import Manifest
from .runtime.engine import splice
from .runtime.pipeline import VLM, peak_rss_mb

IMAGE_PROMPTS = ["Describe this image in detail."]
TEXT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a neural network is to a ten-year-old.",
    "List three uses of a paperclip.",
]


def sample_images() -> list[Path]:
    d = resources.files("vlmrt") / "data"
    return sorted(Path(str(p)) for p in d.iterdir() if p.name.endswith((".png", ".jpg")))


def default_samples(text_only: bool = False) -> list[tuple[Path | None, str]]:
    out: list[tuple[Path | None, str]] = [(None, p) for p in TEXT_PROMPTS]
    if not text_only:
        out += [(img, p) for img in sample_images() for p in IMAGE_PROMPTS]
    return out


def calibration_set(folder: str | Path) -> list[tuple[Path | None, str]]:
    """Images of a folder × its prompts.txt (one per line; default prompts otherwise), plus text-only prompts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"calibration folder not found: {folder}")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp"))
    pf = folder / "prompts.txt"
    prompts = [ln.strip() for ln in pf.read_text().splitlines() if ln.strip()] if pf.is_file() else IMAGE_PROMPTS
    if not images:
        raise ValueError(f"no images in calibration folder {folder}")
    return [(img, p) for img in images for p in prompts] + [(None, p) for p in prompts]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray) -> dict:
    """ref/got [positions, vocab] -> first-token match, top-1 agreement, mean KL(ref‖got)."""
    n = min(len(ref), len(got))
    ref, got = ref[:n], got[:n]
    lr, lg = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    return {"positions": n, "first_token_match": bool(agree[0]), "top1": float(agree.mean()), "kl": float(kl.mean()),
            "agree_count": int(agree.sum()), "kl_sum": float(kl.sum())}


def prompt_embeds(vlm: VLM, image, prompt: str) -> tuple[list[int], np.ndarray]:
    from .runtime import image as img_ops

    m = vlm.manifest
    if image is None:
        ids = vlm.prompt_ids(prompt, None)
        return ids, vlm.engine.embed(ids)
    tiles = img_ops.preprocess(img_ops.load_image(image), m.image)
    ids = vlm.prompt_ids(prompt, tiles.grid)
    return ids, splice(ids, vlm.engine.embed(ids), vlm.encode_image(tiles.pixels), m.special_tokens.image_token_id)


def evaluate(bundle: VLM, reference: VLM, samples, *, tokens: int = 32, mode: str = "hybrid") -> dict:
    per = []
    t0 = time.perf_counter()
    for image, prompt in samples:
        ids, ref_embeds = prompt_embeds(reference, image, prompt)
        seq = list(reference.engine.generate(ref_embeds, mode="hybrid", max_new_tokens=tokens))
        if not seq:  # the reference answered EOS at once: score that single position
            seq = [int(np.argmax(reference.engine.prefill(ref_embeds, "hybrid")))]
        ref_logits = reference.engine.score(ref_embeds, seq, "hybrid")
        ids_b, embeds = prompt_embeds(bundle, image, prompt)
        if ids_b != ids:
            raise ValueError("the bundle and the reference tokenize the prompt differently: not the same model")
        got = bundle.engine.score(embeds, seq, mode)
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
    m.decoder = dataclasses.replace(m.decoder, buckets={})  # the reference has one decoder for every context
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
    from .export.reference import torch_bundle

    return VLM(torch_bundle(ref, float_manifest(bundle.manifest), bundle.bundle.tokenizer))
