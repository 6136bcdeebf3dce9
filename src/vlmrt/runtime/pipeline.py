"""The Python API: load a bundle once, then ask questions about images.

    vlm = VLM.load("bundles/smolvlm")
    for piece in vlm.generate("What is in the image?", image="cat.png"):
        print(piece, end="", flush=True)
    print(vlm.result.stats)       # RunStats of the last call

Everything here executes the manifest: tiling and prompt expansion are named host ops,
graphs and tensor names come from it; no model family is known to this code.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from . import image as img_ops
from .bundle import Bundle
from .engine import MODES, ContextOverflow, Engine, splice
from .prompt import build_prompt
from .sampler import Sampler, SamplingConfig


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


@dataclass
class RunStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    image_tiles: int = 0
    load_s: float = 0.0
    preprocess_s: float = 0.0  # image decode+tiling+normalize, prompt build + tokenize
    vision_s: float = 0.0
    ttft_s: float = 0.0  # from the call to the first token: preprocess + vision + prefill
    prefill_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_ms_per_token: float = 0.0
    total_s: float = 0.0
    peak_rss_mb: float = 0.0
    stop_reason: str = ""


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids), "stats": asdict(self.stats)}


class VLM:
    def __init__(self, bundle: Bundle, load_s: float = 0.0, kv_requant: bool = True):
        """kv_requant: see Engine (HTP bundles in hybrid mode)."""
        self.bundle = bundle
        m = bundle.manifest
        self.manifest = m
        self.load_s = load_s
        io_dtype = m.graphs["decode"].input(m.decoder.embeds_input).dtype
        self.engine = Engine(
            bundle.sessions.get("prefill"), bundle.sessions["decode"], m.kv, m.decoder,
            bundle.embed_table, m.special_tokens.eos_token_ids, io_dtype, bundle.embed_scale, kv_requant,
        )
        self.result = Result()

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             kv_requant: bool = True) -> "VLM":
        t = time.perf_counter()
        b = Bundle.open(path, device=device, threads=threads, verify=verify)
        return cls(b, time.perf_counter() - t, kv_requant)

    # --- host steps -----------------------------------------------------------------------
    def prompt_ids(self, prompt: str, grid: tuple[int, int, int] | None) -> list[int]:
        """Token ids of the templated prompt; grid = (rows, cols, tiles) of the image, None for text only."""
        text = build_prompt(self.manifest.prompt, prompt, grid)
        return self.bundle.tokenizer.encode(text, add_special_tokens=self.manifest.prompt.add_special_tokens).ids

    def encode_image(self, tiles: np.ndarray) -> np.ndarray:
        """[tiles, c, S, S] -> [tiles*tokens_per_tile, hidden] through the vision graph, tile by tile."""
        m = self.manifest
        sess = self.bundle.sessions["vision"]
        dtype = m.graphs["vision"].input(m.vision.patches_input).dtype
        out = [
            sess.run([m.vision.embeds_output], {m.vision.patches_input: img_ops.unfold_patches(t, m.image.patch_size).astype(dtype)})[0]
            for t in tiles
        ]
        return np.concatenate(out).astype(self.engine.dtype, copy=False)

    def prompt_embeds(self, prompt: str, image=None, max_tiles: int | None = None) -> tuple[list[int], np.ndarray]:
        """(prompt ids, prompt embeddings [n, hidden] with the image's rows spliced in) for one request, without the
        timings and the context check of generate()."""
        m = self.manifest
        if image is None:
            ids = self.prompt_ids(prompt, None)
            return ids, self.engine.embed(ids)
        im = img_ops.load_image(image) if not isinstance(image, Image.Image) else img_ops.to_rgb(image)
        tiles = img_ops.preprocess(im, img_ops.with_max_tiles(m.image, max_tiles))
        ids = self.prompt_ids(prompt, tiles.grid)
        return ids, splice(ids, self.engine.embed(ids), self.encode_image(tiles.pixels), m.special_tokens.image_token_id)

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompt: str, image: str | Path | Image.Image | None = None, *, mode: str | None = None,
                 max_new_tokens: int = 256, sampling: SamplingConfig | None = None,
                 ignore_eos: bool = False, max_tiles: int | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are generated; self.result holds text, ids and stats at the end."""
        m = self.manifest
        mode = mode or m.generate.get("default_mode", "hybrid")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        sampler = Sampler(sampling or SamplingConfig())
        res = self.result = Result()
        st = res.stats
        st.load_s = self.load_s
        t0 = time.perf_counter()

        image_embeds, grid = None, None
        if image is not None:
            im = img_ops.load_image(image) if not isinstance(image, Image.Image) else img_ops.to_rgb(image)
            tiles = img_ops.preprocess(im, img_ops.with_max_tiles(m.image, max_tiles))
            grid = tiles.grid
            st.image_tiles = len(tiles.pixels)
        res.prompt_ids = ids = self.prompt_ids(prompt, grid)
        st.prompt_tokens = len(ids)
        if len(ids) >= m.kv.max_context:
            fix = "re-export with a larger --max-seq-len"
            if image is not None and "max_tiles" in m.image.params and st.image_tiles > 1:
                fix = f"use fewer tiles (--max-tiles, this image used {st.image_tiles}) or " + fix
            raise ContextOverflow(
                f"{'image + prompt' if image is not None else 'prompt'} is {len(ids)} tokens but the bundle's max "
                f"context is {m.kv.max_context}; {fix}"
            )
        t1 = time.perf_counter()
        st.preprocess_s = t1 - t0
        if image is not None:
            image_embeds = self.encode_image(tiles.pixels)
        st.vision_s = time.perf_counter() - t1
        embeds = splice(ids, self.engine.embed(ids), image_embeds, m.special_tokens.image_token_id)

        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        pieces = []
        for token in self.engine.generate(embeds, mode=mode, max_new_tokens=max_new_tokens, sampler=sampler, ignore_eos=ignore_eos):
            if not res.token_ids:
                st.ttft_s = time.perf_counter() - t0
            res.token_ids.append(token)
            piece = stream.step(self.bundle.tokenizer, token)
            if piece:
                pieces.append(piece)
                yield piece
        # DecodeStream holds back an incomplete UTF-8 sequence; flush what the full decode has beyond it
        res.text = self.bundle.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        streamed = "".join(pieces)
        if res.text.startswith(streamed) and len(res.text) > len(streamed):
            yield res.text[len(streamed):]
        g = self.engine.last
        st.generated_tokens = g.generated_tokens
        st.prefill_s = g.prefill_s
        st.prefill_tokens_per_s = g.prefill_tokens_per_s
        st.decode_tokens_per_s = g.decode_tokens_per_s
        st.decode_ms_per_token = 1000 * g.decode_s / max(1, g.generated_tokens - 1)
        st.stop_reason = g.stop_reason
        st.total_s = time.perf_counter() - t0
        st.peak_rss_mb = peak_rss_mb()

    def __call__(self, prompt: str, image=None, **kw) -> Result:
        for _ in self.generate(prompt, image, **kw):
            pass
        return self.result
