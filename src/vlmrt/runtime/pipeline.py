"""The Python API: load a bundle once, then ask questions about images.

    vlm = VLM.load("bundles/smolvlm")
    for piece in vlm.generate("What is in the image?", image="cat.png"):   # images=[...]: several
        print(piece, end="", flush=True)
    print(vlm.result.stats)       # RunStats of the last call

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                             {"type": "text", "text": "What is this?"}]}]
    answer = "".join(vlm.chat(messages, max_new_tokens=64))
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
    answer = "".join(vlm.chat(messages))   # reuses the KV rows of the first turn and the image's embeddings

generate() is cache-less: each call computes everything. chat() keeps a prefix cache and an image embedding cache
(runtime/prefix_cache.py); its answers are token for token those of a fresh run of the whole conversation.

Everything here executes the manifest: tiling and prompt expansion are named host ops,
graphs and tensor names come from it; no model family is known to this code.
"""

from __future__ import annotations

import resource
import time
from numbers import Integral
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from . import image as img_ops
from .bundle import Bundle, Sessions
from .positions import position_op, prompt_positions
from .engine import MODES, ContextOverflow, DecoderSessions, Engine, EngineConfig, check_lookahead, splice
from .lookahead import check_exact
from .conversation import ChatTemplate, Conversation, parse_messages, user_turn
from .prefix_cache import CachedImage, ImageCache, PrefixCache, row_keys
from .prompt import build_prompt
from .sampler import Sampler, SamplingConfig
from .sources import FetchLimits, read_image
from .stop_strings import StopStrings

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_IMAGE_CACHE_BYTES = 64 * 1024 * 1024


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


@dataclass
class RunStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    image_tiles: int = 0
    load_s: float = 0.0  # VLM.load: manifest, tokenizer, decoder session (the vision session is loaded on first use)
    vision_load_s: float = 0.0  # this call's loading of the vision session (its first image), in ttft_s, not vision_s
    preprocess_s: float = 0.0  # image decode+tiling+normalize, prompt build + tokenize
    vision_s: float = 0.0
    ttft_s: float = 0.0  # from the call to the first token: preprocess + vision + prefill
    prefill_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_ms_per_token: float = 0.0
    total_s: float = 0.0
    peak_rss_mb: float = 0.0
    stop_reason: str = ""  # eos | length | context | stop (a stop string)
    images: int = 0
    images_cached: int = 0  # images whose embeddings came from the image cache (chat)
    vision_skipped: bool = False  # images were given and none went through the vision graph
    reused_prompt_tokens: int = 0  # leading prompt tokens whose KV rows were kept from the previous turn (chat)
    drafted_tokens: int = 0  # lookahead: drafts verified, and those accepted (see GenerationStats)
    accepted_tokens: int = 0


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids), "stats": asdict(self.stats)}


class VLM:
    def __init__(self, bundle: Bundle, load_s: float = 0.0, kv_requant: bool = True,
                 image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES, fetch: FetchLimits = FetchLimits(),
                 lookahead: int = 0):
        """kv_requant: see Engine (HTP bundles in hybrid mode). image_cache_bytes: bound of chat()'s image embedding
        cache. fetch: limits on images fetched from http(s) URLs. lookahead: draft length of lookahead decoding
        (greedy answers; 0 = off; see Engine)."""
        self.bundle = bundle
        m = bundle.manifest
        self.manifest = m
        self.load_s = load_s
        self.lazy_load_s = 0.0  # seconds spent loading sessions on first use (the vision graph's), accumulated
        io_dtype = m.graphs["decode"].input(m.decoder.embeds_input).dtype
        check_lookahead(m.decoder, lookahead)
        check_exact(m.graphs["decode"], lookahead)
        position_op(m.decoder.positions)  # (a bundle naming an op this vlmrt lacks fails at load)
        # a static bundle's verify graph (the HTP target), loaded only for lookahead
        verify = bundle.sessions["verify"] if lookahead and getattr(m.decoder.kind, "verify_ar", 0) else None
        sessions = DecoderSessions(decode=bundle.sessions["decode"], prefill=bundle.sessions.get("prefill"),
                                   verify=verify, head=bundle.sessions.get("head"))
        config = EngineConfig(m.kv, m.decoder, m.special_tokens.eos_token_ids, io_dtype, kv_requant, lookahead)
        self.engine = Engine(sessions, config, bundle.embed_table, bundle.embed_scale)
        self.result = Result()
        self.template = ChatTemplate(m.prompt)
        self.prefix = PrefixCache(self.engine.cache)
        self.image_cache = ImageCache(image_cache_bytes)
        self.fetch = fetch
        self._answers = 0  # answers begun: one VLM answers one at a time (its KV cache is one conversation's)

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             kv_requant: bool = True, htp_arch: str | int | None = None, **options) -> "VLM":
        """options: image_cache_bytes, fetch, lookahead (see __init__); htp_arch: see Bundle.open."""
        t = time.perf_counter()
        b = Bundle.open(path, device=device, threads=threads, verify=verify, htp_arch=htp_arch)
        return cls(b, time.perf_counter() - t, kv_requant, **options)

    # --- host steps -----------------------------------------------------------------------
    def prompt_ids(self, prompt: str, grid: tuple[int, int, int] | None) -> list[int]:
        """Token ids of the templated prompt; grid = (rows, cols, tiles) of the image, None for text only."""
        text = build_prompt(self.manifest.prompt, prompt, grid)
        return self.bundle.tokenizer.encode(text, add_special_tokens=self.manifest.prompt.add_special_tokens).ids

    def conversation_ids(self, messages: list[dict], grids: list[tuple[int, int, int]]) -> list[int]:
        """Token ids of a conversation (chat messages) with its images' grids (rows, cols, tiles), in order."""
        text = self.template.render(parse_messages(messages), grids)
        return self.bundle.tokenizer.encode(text, add_special_tokens=self.manifest.prompt.add_special_tokens).ids

    def encode_image(self, tiles: np.ndarray) -> np.ndarray:
        """[tiles, c, S, S] -> [tiles*tokens_per_tile, hidden] through the vision graph, tile by tile."""
        m = self.manifest
        sessions, t = self.bundle.sessions, time.perf_counter()
        first = isinstance(sessions, Sessions) and not sessions.loaded("vision")
        sess = sessions["vision"]  # loaded on first use
        if first:
            self.lazy_load_s += time.perf_counter() - t
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
        im = img_ops.load_image(image) if not img_ops.is_pil_image(image) else img_ops.to_rgb(image)
        tiles = img_ops.preprocess(im, img_ops.with_max_tiles(m.image, max_tiles))
        ids = self.prompt_ids(prompt, tiles.grid)
        return ids, splice(ids, self.engine.embed(ids), self.encode_image(tiles.pixels), m.special_tokens.image_token_id)

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompt: str, image: str | Path | Image.Image | None = None, *, images=(), mode: str | None = None,
                 max_new_tokens: int = 256, sampling: SamplingConfig | None = None, ignore_eos: bool = False,
                 max_tiles: int | None = None, stop: list[str] | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are generated; self.result holds text, ids and stats at the end. The prompt is
        one user turn: image (and then images: paths, URLs, data URIs or PIL images) in order, then the text.
        Cache-less: nothing is kept from or for other calls."""
        srcs = ([image] if image is not None else []) + list(images)
        return self._answer(parse_messages(user_turn(prompt, srcs)), False, mode, max_new_tokens,
                            sampling or SamplingConfig(), ignore_eos, max_tiles, stop)

    def chat(self, messages: list[dict], *, mode: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             ignore_eos: bool = False, max_tiles: int | None = None) -> Iterator[str]:
        """Answer the next assistant turn of a conversation (OpenAI-style messages: system / user / assistant,
        content a string or parts {"type": "text", "text"} / {"type": "image_url", "image_url": {"url"}}), yielding
        text pieces like generate. KV rows of the previous call's prompt + answer that the new prompt starts with
        are kept, images already encoded (same bytes) are not encoded again; the answer is the same token for token
        as a fresh run's. self.result.stats: reused_prompt_tokens, images_cached, vision_skipped."""
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return self._answer(parse_messages(messages), True, mode, max_new_tokens, sampling, ignore_eos, max_tiles, stop)

    def reset(self) -> None:
        """Forget the conversation caches (the KV rows stay allocated: they are the engine's cache)."""
        self.prefix.clear()
        self.image_cache.clear()

    def cache_bytes(self) -> dict:
        """Memory held: the KV cache (allocated once, max_context rows) and the image embedding cache (bounded)."""
        return {"kv_cache": self.engine.cache.nbytes, "image_cache": self.image_cache.bytes,
                "image_cache_limit": self.image_cache.max_bytes, "images_cached": len(self.image_cache)}

    def _images(self, conv: Conversation, cached: bool, max_tiles: int | None):
        """Per image (key, grid, cached embeddings or None, tiles or None), and how many came from the cache."""
        spec = img_ops.with_max_tiles(self.manifest.image, max_tiles)
        out, hits = [], 0
        for src in conv.images:
            s = read_image(src, self.fetch)
            key = (s.digest, max_tiles)
            item = self.image_cache.get(key) if cached else None
            if item is not None:
                hits += 1
                out.append((key, item.grid, item.embeds, None))
            else:
                tiles = img_ops.preprocess(s.image, spec)
                out.append((key, tiles.grid, None, tiles))
        return out, hits

    def _overflow(self, n: int, grids: list) -> ContextOverflow:
        m = self.manifest
        tiles = [g[2] for g in grids]
        fix = "re-export with a larger --max-seq-len"
        if grids and "max_tiles" in m.image.params and max(tiles) > 1:
            fix = "use fewer tiles (--max-tiles) or " + fix
        if len(grids) > 1:
            fix = "use fewer images, " + fix
        what = {0: "prompt", 1: "image + prompt"}.get(len(grids), f"{len(grids)} images + prompt")
        per = f" (tiles per image: {', '.join(map(str, tiles))}; {m.prompt.tokens_per_tile} tokens per tile)" if grids else ""
        return ContextOverflow(f"{what} is {n} tokens{per} but the bundle's max context is {m.kv.max_context}; {fix}")

    def _answer(self, conv: Conversation, cached: bool, mode, max_new_tokens, sampling, ignore_eos, max_tiles,
                stop) -> Iterator[str]:
        m = self.manifest
        mode = mode or m.generate.get("default_mode", "hybrid")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral):
            raise TypeError(f"max_new_tokens must be an integer, not {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        sampler, cut = Sampler(sampling), StopStrings(stop)
        self._answers += 1
        me = self._answers
        res = self.result = Result()
        st = res.stats
        st.load_s = self.load_s
        t0 = time.perf_counter()

        images, st.images_cached = self._images(conv, cached, max_tiles)
        grids = [g for _, g, _, _ in images]
        st.images, st.image_tiles = len(images), sum(g[2] for g in grids)
        text = self.template.render(conv, grids)
        res.prompt_ids = ids = self.bundle.tokenizer.encode(text, add_special_tokens=m.prompt.add_special_tokens).ids
        st.prompt_tokens = len(ids)
        if len(ids) >= m.kv.max_context:
            raise self._overflow(len(ids), grids)
        per_tile = m.prompt.tokens_per_tile
        keys = row_keys(ids, m.special_tokens.image_token_id, [(k, g[2] * per_tile) for k, g, _, _ in images])
        start = self.engine.reusable(mode, min(self.prefix.common(keys), len(ids) - 1)) if cached else 0
        st.reused_prompt_tokens = start
        t1 = time.perf_counter()
        st.preprocess_s = t1 - t0

        # image rows: from the cache, from the vision graph, or none for an image wholly inside the kept prefix
        embeds = self.engine.embed(ids[start:])
        slots = np.flatnonzero(np.asarray(ids) == m.special_tokens.image_token_id)
        at, encoded, lazy0 = 0, 0, self.lazy_load_s
        for key, grid, rows, tiles in images:
            s = slots[at : at + grid[2] * per_tile]
            at += len(s)
            if s[-1] < start:
                continue
            if rows is None:
                rows = self.encode_image(tiles.pixels)
                encoded += 1
                if cached:
                    self.image_cache.put(key, CachedImage(grid, rows))
            keep = s >= start
            embeds[s[keep] - start] = rows[keep]
        st.vision_load_s = self.lazy_load_s - lazy0
        st.vision_s = time.perf_counter() - t1 - st.vision_load_s
        st.vision_skipped = bool(images) and encoded == 0

        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        fed = ""  # the decoded text given to cut
        if cached:
            self.prefix.clear()  # the cache's rows change from here on; record() says what they hold at the end
        positions = prompt_positions(m.decoder.positions, ids, start, self.engine.cache.position_after(start))
        gen = self.engine.generate(embeds, mode=mode, max_new_tokens=max_new_tokens, sampler=sampler,
                                   ignore_eos=ignore_eos, start=start, prompt_ids=ids, positions=positions)
        done = False
        try:
            for token in gen:
                if not res.token_ids:
                    st.ttft_s = time.perf_counter() - t0
                res.token_ids.append(token)
                piece = stream.step(self.bundle.tokenizer, token)
                if piece:
                    fed += piece
                    out = cut.feed(piece)
                    if out:
                        yield out
                        self._still_mine(me)  # before the next step writes a KV row another answer may own
                    if cut.stopped:
                        break
            done = True
        finally:
            gen.close()
            # else the prefill failed, or another answer has used the rows since: what they hold is not ours to say
            if cached and (done or res.token_ids) and self._answers == me:
                self.prefix.record(keys + res.token_ids)
        # DecodeStream holds back an incomplete UTF-8 sequence; flush what the full decode has beyond it
        full = self.bundle.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        if not cut.stopped and full.startswith(fed) and len(full) > len(fed):
            out = cut.feed(full[len(fed):])
            if out:
                yield out
        out = cut.flush()
        if out:
            yield out
        res.text = cut.text if (cut.stopped or full.startswith(fed)) else full
        g = self.engine.last
        st.generated_tokens = len(res.token_ids)
        st.prefill_s = g.prefill_s
        st.prefill_tokens_per_s = g.prefill_tokens_per_s
        st.decode_tokens_per_s = g.decode_tokens_per_s
        st.drafted_tokens, st.accepted_tokens = g.drafted_tokens, g.accepted_tokens
        st.decode_ms_per_token = 1000 * g.decode_s / max(1, len(res.token_ids) - 1)
        st.stop_reason = "stop" if cut.stopped else g.stop_reason
        st.total_s = time.perf_counter() - t0
        st.peak_rss_mb = peak_rss_mb()

    def _still_mine(self, me: int) -> None:
        if self._answers != me:
            raise RuntimeError("this answer cannot go on: the VLM began another one (generate / chat) since, over the "
                               "same KV cache; a VLM answers one request at a time (use one VLM per concurrent answer)")

    def __call__(self, prompt: str, image=None, **kw) -> Result:
        for _ in self.generate(prompt, image, **kw):
            pass
        return self.result
