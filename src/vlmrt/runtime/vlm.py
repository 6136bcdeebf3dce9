"""The Python API: load a bundle once, then ask questions about images.

    vlm = VLM.load("bundles/smolvlm")
    for piece in vlm.generate("What is in the image?", image="cat.png"):   # images=[...]: several
        print(piece, end="", flush=True)
    print(vlm.result.stats)       # RunStats of the last call
    vlm("Name the shape.", "cat.png", logprobs=5).logprobs   # each token's TokenLogprob (token, bytes, logprob, top 5)

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                             {"type": "text", "text": "What is this?"}]}]
    answer = "".join(vlm.chat(messages, max_new_tokens=64))
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
    answer = "".join(vlm.chat(messages))   # reuses the KV rows of the first turn and the image's embeddings

generate() is cache-less: each call computes everything. chat() keeps a prefix cache and an image embedding cache
(runtime/decode/prefix_cache.py); its answers are token for token those of a fresh run of the whole conversation.

Everything here executes the manifest: tiling and prompt expansion are named host ops,
graphs and tensor names come from it; no model family is known to this code.
"""

from __future__ import annotations

import resource
import sys
import time
from numbers import Integral
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .media import image as img_ops
from .media import tile_inputs
from .bundle import Bundle
from .sessions import Sessions
from .prompt.chunks import ImageChunk, Prompt
from .prompt.positions import position_op, prompt_positions
from .prompt.prompt_rows import PromptRows
from .decode.cache_row import MODES, ContextOverflow, DecoderConfig, DecoderSessions, check_lookahead
from .decode.decoder_kinds import decoder_kind
from .decode.logprobs import MAX_TOP, TokenLogprob
from .decode.lookahead import check_exact
from .media import video as video_ops
from .prompt.conversation import (ChatTemplate, Conversation, VideoSource, control_strings, parse_messages, user_turn,
                           video_refusal)
from .decode.prefix_cache import ImageCache, PrefixCache
from .media.image_native import with_max_patches
from .prompt.build import build
from .decode.grammar import Constraint, GrammarError, Grammars, GrammarSpec
from .decode.sampler import Sampler, SamplingConfig
from .decode.scheduler import Scheduler
from .decode.sequence import Sequence
from .media.sources import FetchLimits, read_image
from .prompt.stop_strings import StopStrings
from .prompt.token_bytes import TokenBytes
from .prompt.tool_calls import call_grammar

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_IMAGE_CACHE_BYTES = 64 * 1024 * 1024


PIXELS_HINT = "vlmrt run, chat and batch: --max-pixels MP raises it"


def check_pixels(sources: list, spec, limit: int) -> None:
    """The decoded-pixel budget of one prompt (FetchLimits.max_pixels; docs/limits.md): the images to decode, from their
    headers, each and together at most limit pixels (a JPEG counted at the size it is decoded to); else one
    ImageError, before any pixel is decoded."""
    total = 0
    for s in sources:
        try:
            total += s.header(spec, limit).pixels
        except img_ops.TooManyPixels as e:
            raise img_ops.TooManyPixels(f"{e} ({PIXELS_HINT})") from None
    if total > limit:
        raise img_ops.TooManyPixels(f"the prompt's {len(sources)} images decode to {total / 1e6:.1f} million pixels "
                                    f"together; vlmrt decodes up to {limit / 1e6:g} million per prompt ({PIXELS_HINT})")


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB: Linux's VmHWM (the high-water mark of this program's own memory).
    Not ru_maxrss there: the kernel carries it over exec, so a process started by a larger one (vfork + exec, as
    Python's subprocess does) reported its parent's peak (a `vlmrt run` started by a 5 GB test process: 5091 MB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024.0  # kB
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2.0**20 if sys.platform == "darwin" else 1024.0)


@dataclass
class DecoderInputs:
    """A prompt's decoder inputs from a slot on (VLM.decoder_inputs): vlm.row.prefill(x.embeds, mode,
    positions=x.positions, rows=x.rows, spans=x.spans)."""

    embeds: np.ndarray  # [n, hidden]
    positions: np.ndarray  # [rope rows, n] int64
    rows: np.ndarray | None  # [n, decoder.row_input.width], or None
    spans: np.ndarray | None = None  # [n] int64: each row's image span (decoder.span_input), or None


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
    stop_reason: str = ""  # eos | length | context | stop (a stop string) | grammar (the response format complete)
    images: int = 0  # images and video frames
    images_cached: int = 0  # images (and video frames) whose embeddings came from the image cache (chat)
    # images this call made smaller than their processor would, to fit the vision graph's patch budget (native-
    # resolution families: the image is resized, never refused); one from the image cache is not counted again
    images_resized: int = 0
    videos: int = 0
    video_frames: int = 0  # frames sampled from the videos (one tile each; counted in images too)
    vision_skipped: bool = False  # images were given and none went through the vision graph
    reused_prompt_tokens: int = 0  # leading prompt tokens whose KV rows were kept from the previous turn (chat)
    drafted_tokens: int = 0  # lookahead: drafts verified, and those accepted (see GenerationStats)
    accepted_tokens: int = 0
    grammar_compile_s: float = 0.0  # compiling the response format's grammar (0: none, or a cached one)
    # a recurrent state (Qwen3.5): snapshots at the prompt's block ends, lookahead calls run again (GenerationStats)
    state_snapshots: int = 0
    snapshot_ms: float = 0.0
    state_replays: int = 0
    replay_ms: float = 0.0


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)
    logprobs: list[TokenLogprob] | None = None  # asked for (logprobs=N): one per token_ids entry, in order

    def to_dict(self) -> dict:
        """`vlmrt run --json`'s object (and a `vlmrt batch` answer's line): with logprobs when they were asked for, in
        OpenAI's shape (TokenLogprob.as_dict)."""
        lp = {} if self.logprobs is None else {"logprobs": [e.as_dict() for e in self.logprobs]}
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "stats": asdict(self.stats), **lp}


@dataclass(eq=False)
class Answer:
    """One answer in progress (VLM.prepare, encode, admit, stream, finish): its options, prompt, sequence and text."""

    me: int  # VLM._answers when it began
    slot: int  # its VLM's row of the scheduler (VLM.slot)
    cached: bool  # chat: prefix and image caches
    mode: str
    max_new_tokens: int
    sampler: Sampler
    ignore_eos: bool
    cut: StopStrings
    res: Result
    t0: float  # perf_counter at the call
    logprobs: int | None = None  # the top tokens to report beside each token's log probability (None: none)
    prompt: Prompt | None = None
    keys: list = field(default_factory=list)  # the prompt rows' keys (PrefixCache)
    start: int = 0  # prompt rows kept from the previous answer
    media: bool = False  # the prompt has images or video frames
    seq: Sequence | None = None
    fed: str = ""  # the decoded text given to cut
    recording: bool = False  # the prefix cache is to record the row's rows when it is over
    decode: object = None  # tokenizers' DecodeStream
    constraint: Constraint | None = None  # the grammar its tokens are held to (response_format)

    def __post_init__(self):
        from tokenizers.decoders import DecodeStream

        self.decode = DecodeStream(skip_special_tokens=True)


class VLM:
    def __init__(self, bundle: Bundle, load_s: float = 0.0, kv_requant: bool = True,
                 image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES, fetch: FetchLimits = FetchLimits(),
                 lookahead: int = 0, allow_special_tokens: bool = False, scheduler: Scheduler | None = None,
                 row: int = 0, grammars: Grammars | None = None):
        """kv_requant: see DecoderConfig (HTP bundles in hybrid mode). image_cache_bytes: bound of chat()'s image
        embedding cache. fetch: limits on images fetched from http(s) URLs. lookahead: draft length of lookahead
        decoding (greedy answers; 0 = off; see DecoderConfig). allow_special_tokens: message text that holds a control
        token's string (<|im_start|>, <end_of_utterance>, ...) gets that token, as transformers' tokenizers do; by
        default it is tokenized as plain text (docs/conversations.md). scheduler, row: the scheduler its answers run
        through and its cache row there (VLM.slots: several VLMs over one scheduler); None: a scheduler of its own,
        of one row (kv_requant and lookahead are the scheduler's). grammars: the bundle's grammar compiler
        (runtime/decode/grammar.py; VLM.slots share one), None: one of its own."""
        self.bundle = bundle
        m = bundle.manifest
        self.manifest = m
        self.load_s = load_s
        self.lazy_load_s = 0.0  # seconds spent loading sessions on first use (the vision graph's), accumulated
        position_op(m.decoder.positions)  # (a bundle naming an op this vlmrt lacks fails at load)
        self.scheduler = scheduler or self.scheduler_for(bundle, 1, kv_requant, lookahead)
        self.slot = row
        self.row = self.scheduler.rows[row]  # its cache rows and the one-sequence calls on them
        self.result = Result()
        self.template = ChatTemplate(m.prompt, () if allow_special_tokens else control_strings(bundle.tokenizer))
        # the special tokens of the template's tool-call syntax that an answer's text keeps (Gemma 4's <|tool_call>,
        # <tool_call|>, <|"|>: without them its calls cannot be read); every other special token is left out
        kept = self.template.tool_format.kept if self.template.tool_format is not None else ()
        self._kept = {i: t.content for i, t in bundle.tokenizer.get_added_tokens_decoder().items()
                      if t.special and t.content in kept}
        self.prefix = PrefixCache(self.row.cache)
        self.image_cache = ImageCache(image_cache_bytes)
        self.fetch = fetch
        self.grammars = grammars or self.grammars_for(bundle, self.scheduler)
        self._answers = 0  # answers begun: one VLM answers one at a time (its KV cache is one conversation's)
        self._token_bytes: TokenBytes | None = None  # (made at the first answer that asks for logprobs)

    @staticmethod
    def scheduler_for(bundle: Bundle, rows: int, kv_requant: bool = True, lookahead: int = 0) -> Scheduler:
        """A scheduler of `rows` cache rows over the bundle's decoder sessions (runtime/decode/scheduler.py)."""
        m = bundle.manifest
        io_dtype = m.graphs["decode"].input(m.decoder.embeds_input).dtype
        check_lookahead(m.decoder, lookahead)
        check_exact(m.graphs["decode"], lookahead)
        # a static bundle's verify graph (the HTP target), loaded only for lookahead
        verify = bundle.sessions["verify"] if lookahead and m.decoder.kind.parts().verify_ar else None
        sessions = DecoderSessions(decode=bundle.sessions["decode"], prefill=bundle.sessions.get("prefill"),
                                   verify=verify, head=bundle.sessions.get("head"))
        # the prompt block the attention kernel wants (ORT's `scores` kernel holds a call's scores: gqa_kernel.py)
        dec = replace(m.decoder, prefill_ar=decoder_kind(m.decoder, m.kv).prompt_block(bundle.prefill_rows))
        config = DecoderConfig(m.kv, dec, m.special_tokens.eos_token_ids, io_dtype, kv_requant, lookahead)
        return Scheduler(sessions, config, bundle.embed_table, bundle.embed_scale, rows)

    @staticmethod
    def grammars_for(bundle: Bundle, scheduler: Scheduler) -> Grammars:
        """The bundle's grammar compiler (llguidance's tokenizer built on the first grammar)."""
        return Grammars(bundle.tokenizer, scheduler.embedding.vocab, bundle.manifest.special_tokens.eos_token_ids)

    @classmethod
    def slots(cls, bundle: Bundle, n: int, load_s: float = 0.0, kv_requant: bool = True, lookahead: int = 0,
              **options) -> list["VLM"]:
        """n VLMs over one opened bundle and one scheduler of n rows (a server's slots, a batch job's sequences),
        VLM i on row i: their answers decode together, one decoder call per round where the graph takes a batch
        (runtime/decode/scheduler.py), the call width probed (Scheduler.probe) so that an answer does not depend on the
        load. options: the other VLM keyword arguments (image_cache_bytes per VLM, fetch, ...)."""
        sched = cls.scheduler_for(bundle, n, kv_requant, lookahead)
        sched.probe()
        grammars = cls.grammars_for(bundle, sched)
        return [cls(bundle, load_s, scheduler=sched, row=i, grammars=grammars, **options) for i in range(n)]

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             kv_requant: bool = True, htp_arch: str | int | None = None, **options) -> "VLM":
        """options: image_cache_bytes, fetch, lookahead (see __init__); htp_arch: see Bundle.open."""
        t = time.perf_counter()
        b = Bundle.open(path, device=device, threads=threads, verify=verify, htp_arch=htp_arch)
        return cls(b, time.perf_counter() - t, kv_requant, **options)

    # --- host steps -----------------------------------------------------------------------
    def prompt(self, messages: list[dict] | str, images=(), *, max_tiles: int | None = None,
               media: list[ImageChunk] | None = None) -> Prompt:
        """The prompt (typed chunks, runtime/prompt/chunks.py) of a conversation, or of one user turn (a str: images in
        order, then the text), built as every call builds it; its images read and tiled, not yet encoded.
        media: the images' chunks already read (VLM.media), to build many prompts over the same images."""
        conv = parse_messages(user_turn(messages, list(images)) if isinstance(messages, str) else messages)
        if media is not None:
            return self._build(conv, media)
        images, videos, _ = self._media(conv, False, max_tiles)
        return self._build(conv, images, videos)

    def media(self, images, max_tiles: int | None = None) -> list[ImageChunk]:
        """The images (paths, URLs, data URIs or PIL images) read and tiled, for VLM.prompt(media=...)."""
        return self._media(Conversation([], list(images)), False, max_tiles)[0]

    def embed_prompt(self, prompt: Prompt, start: int = 0, cache: bool = False) -> np.ndarray:
        """Prompt embeddings [n - start, hidden]: the token rows of ids[start:] with the image rows spliced in, the
        image chunks that still need them run through the vision graph (and kept in the image cache if cache)."""
        for c in prompt.needs_rows(start):
            if c.embeds is None:
                self._encode_chunk(c, cache)
        return prompt.splice(self.scheduler.embed(prompt.ids[start:]), start)

    def _encode_chunk(self, c, cache: bool) -> None:
        """An image chunk's rows through the vision graph (kept in the image cache if cache)."""
        for _ in self._encode_tiles(c, cache):
            pass

    def _encode_tiles(self, c, cache: bool) -> Iterator[None]:
        """_encode_chunk one vision graph call at a time: yields after each tile's call, sets c.embeds after the
        last (and keeps them in the image cache if cache)."""
        rows = []
        for r in tile_inputs.encode_tiles(self._vision(), c.pixels, c.patch_grids, self.manifest):
            rows.append(r)
            yield
        c.embeds = np.concatenate(rows).astype(self.row.dtype, copy=False)
        c.pixels = None  # (spent: the image cache keeps this record for its rows, not its pixels)
        if cache:
            self.image_cache.put(c.key, c)

    def decoder_inputs(self, prompt: Prompt, start: int = 0, cache: bool = False) -> DecoderInputs:
        """What the decoder takes for the prompt's slots start..: embeddings (embed_prompt), rope positions
        (the bundle's positions op) and, where the decoder has one (decoder.row_input), the row input."""
        embeds = self.embed_prompt(prompt, start, cache)
        return DecoderInputs(embeds, *self._positions_rows(prompt, start))

    def _positions_rows(self, prompt: Prompt, start: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(rope positions, row input or None, image spans or None) of the prompt's slots start.. (see
        decoder_inputs)."""
        d = self.manifest.decoder
        positions = prompt_positions(d.positions, prompt, start, self.row.cache.position_after(start))
        rows = prompt.row_input(d.hidden_size, d.row_input.width, self.row.dtype, start) if d.row_input else None
        return positions, rows, prompt.spans(start) if d.span_input else None

    def prompt_embeds(self, prompt: str, image=None, max_tiles: int | None = None) -> tuple[list[int], np.ndarray]:
        """(prompt ids, prompt embeddings [n, hidden]) of one user turn (an image, then the text), without the
        timings and the context check of generate()."""
        p = self.prompt(prompt, [] if image is None else [image], max_tiles=max_tiles)
        return p.ids, self.embed_prompt(p)

    def encode_image(self, tiles: np.ndarray, patch_grids: np.ndarray | None = None) -> np.ndarray:
        """[tiles, c, S, S] (NaFlex, native resolution: [tiles, patches, d] and their patch grids) -> [the tiles' image
        tokens, hidden (+ the row outputs' width)] through the vision graph, tile by tile (the manifest's tile-inputs
        op: runtime/media/tile_inputs.py)."""
        return tile_inputs.encode(self._vision(), tiles, patch_grids, self.manifest).astype(self.row.dtype, copy=False)

    def _vision(self):
        """The vision graph's session, loaded on first use (its load time counted in lazy_load_s)."""
        sessions, t = self.bundle.sessions, time.perf_counter()
        first = isinstance(sessions, Sessions) and not sessions.loaded("vision")
        sess = sessions["vision"]
        if first:
            self.lazy_load_s += time.perf_counter() - t
        return sess

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompt: str, image: str | Path | Image.Image | None = None, *, images=(), mode: str | None = None,
                 max_new_tokens: int = 256, sampling: SamplingConfig | None = None, ignore_eos: bool = False,
                 max_tiles: int | None = None, stop: list[str] | None = None, video=None, fps: float | None = None,
                 max_frames: int | None = None, max_patches: int | None = None,
                 response_format: dict | GrammarSpec | None = None, logprobs: int | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are generated; self.result holds text, ids and stats at the end. The prompt is
        one user turn: the video if any (a GIF / WebP / mp4 / webm file, a folder of numbered frames at fps, a URL,
        a data URI or a list of PIL images at fps; docs/video.md), image (and then images: paths, URLs, data URIs or
        PIL images) in order, then the text. max_frames: sample at most this many frames (default: the bundle's).
        max_patches: a smaller patch budget per image than the bundle's vision graph (native-resolution bundles:
        the image is resized to fit, as its processor does with max_pixels = patches × patch²).
        response_format: the answer held to a grammar: OpenAI's {"type": "json_object"} / {"type": "json_schema",
        "json_schema": {"schema": {...}, "strict": true}}, or a GrammarSpec (a JSON schema, a Lark grammar, a regex;
        runtime/decode/grammar.py); a grammar that is complete ends the answer (stop_reason "grammar"), max_new_tokens
        reached first leaves it partial ("length").
        logprobs: N (0..20) records each generated token's log probability and the N most likely tokens at its
        place in self.result.logprobs (TokenLogprob: id, token, bytes, logprob, top), from the model's logits before
        temperature / top-k / top-p and before the grammar's mask (runtime/decode/logprobs.py); None: none (and nothing
        computed).
        Cache-less: nothing is kept from or for other calls."""
        srcs = ([image] if image is not None else []) + list(images)
        videos = [VideoSource(video, fps)] if video is not None else []
        return self._run(lambda: self.prepare(
            parse_messages(user_turn(prompt, srcs, videos)), False, mode, max_new_tokens, sampling or SamplingConfig(),
            ignore_eos, max_tiles, stop, max_frames, max_patches, response_format, logprobs))

    def chat(self, messages: list[dict], *, mode: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             ignore_eos: bool = False, max_tiles: int | None = None, max_frames: int | None = None,
             max_patches: int | None = None, tools: list[dict] | None = None, tool_choice: str | None = None,
             parallel_tool_calls: bool = True, response_format: dict | GrammarSpec | None = None,
             logprobs: int | None = None) -> Iterator[str]:
        """Answer the next assistant turn of a conversation (OpenAI-style messages: system / user / assistant,
        content a string or parts {"type": "text", "text"} / {"type": "image_url", "image_url": {"url"}} /
        {"type": "video_url", "video_url": {"url"}} (or {"type": "video", "video": src, "fps": N})), yielding
        text pieces like generate. KV rows of the previous call's prompt + answer that the new prompt starts with
        are kept, images and video frames already encoded (same pixels) are not encoded again; the answer is the same
        token for token as a fresh run's. self.result.stats: reused_prompt_tokens, images_cached, vision_skipped.
        tools: functions the answer may call (OpenAI's [{"type": "function", "function": {...}}]), rendered by the
        checkpoint's template (or described in a system turn: runtime/prompt/tool_calls.py); messages may then hold
        assistant tool_calls and tool results. The answer is text: self.template.tool_format.parse reads its calls.
        tool_choice: "required" (the answer calls one or more of tools; one with parallel_tool_calls False) or a
        function's name (it calls that one, once), the calls held to the grammar of the template's tool format with
        each function's parameters as the schema of its arguments (runtime/prompt/tool_calls.py call_grammar); None /
        "auto": the answer may be text.
        response_format, logprobs: as generate's."""
        return self._run(lambda: self.chat_answer(messages, mode=mode, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                          max_tiles=max_tiles, max_frames=max_frames, max_patches=max_patches,
                                          tools=tools, tool_choice=tool_choice,
                                          parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                                          logprobs=logprobs))

    def chat_answer(self, messages: list[dict], *, mode: str | None = None, max_new_tokens: int = 256,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    stop: list[str] | None = None, ignore_eos: bool = False, max_tiles: int | None = None,
                    max_frames: int | None = None, max_patches: int | None = None,
                    tools: list[dict] | None = None, tool_choice: str | None = None, parallel_tool_calls: bool = True,
                    response_format: dict | GrammarSpec | None = None, logprobs: int | None = None) -> "Answer":
        """chat()'s answer prepared (VLM.prepare), for an AnswerLoop to run with others' (runtime/answers.py: the
        server's slots, vlmrt batch). Raises on bad input."""
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        response_format = self.answer_grammar(tools, tool_choice, parallel_tool_calls, response_format)
        if tools and any(t["function"].get("strict") for t in tools):  # (the template renders them without it)
            tools = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools]
        return self.prepare(parse_messages(messages, tools), True, mode, max_new_tokens, sampling, ignore_eos,
                            max_tiles, stop, max_frames, max_patches, response_format, logprobs)

    def answer_grammar(self, tools: list[dict] | None = None, tool_choice: str | None = None,
                       parallel_tool_calls: bool = True, response_format=None) -> GrammarSpec | None:
        """The grammar chat_answer holds an answer to (None: free text), as chat's arguments say, compiled (cached by
        the bundle's Grammars, so that a caller may compile it ahead: the server does, off its model thread);
        GrammarError naming the field for one that cannot be."""
        strict = {t["function"]["name"] for t in tools or () if t["function"].get("strict")}
        tools = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools or ()]
        if tool_choice not in (None, "auto", "none"):
            if response_format is not None:
                raise GrammarError("a response format and a required or named tool_choice ask for two answers")
            spec = self._call_grammar(tools, tool_choice, parallel_tool_calls)
        elif strict and tool_choice != "none" and response_format is None:
            spec = self._call_grammar(tools, None, parallel_tool_calls, strict)
        else:
            spec = response_format if isinstance(response_format, (GrammarSpec, type(None))) else \
                GrammarSpec.from_response_format(response_format)
        if spec is not None:
            try:
                self.grammars.compile(spec)
            except GrammarError as e:
                if e.param == "tools":
                    self._bad_tool(tools)  # (names the function)
                raise
        return spec

    def _call_grammar(self, tools: list[dict], tool_choice: str | None, many: bool,
                      strict: set[str] | None = None) -> GrammarSpec:
        """The grammar of an answer that calls tools (tool_choice "required": one or more where many) or the one
        named (once); tool_choice None (auto with strict tools): text or calls, the strict functions' arguments held
        to their schemas."""
        named = tool_choice not in (None, "required")
        at = [i for i, t in enumerate(tools) if not named or t["function"]["name"] == tool_choice]
        if not at:
            raise GrammarError(f"{str(tool_choice)[:64]!r} is not one of the tools" if tools else "needs tools",
                               "tool_choice")
        fmt = self.template.tool_format
        if fmt is None:  # (a template whose tool format vlmrt does not know: tools are refused before)
            raise GrammarError(self.template.tools_refusal(), "tools")
        return call_grammar(fmt, [tools[i] for i in at], self.grammars.literal, many and not named,
                            optional=tool_choice is None, held=strict, at=at)

    def _bad_tool(self, tools: list[dict]) -> None:
        """The GrammarError of the first function whose parameters do not compile, if one does not."""
        for i, t in enumerate(tools):
            self.grammars.compile(GrammarSpec.json_schema(t["function"].get("parameters") or {"type": "object"},
                                                          param=f"tools[{i}].function.parameters"))

    def reset(self) -> None:
        """Forget the conversation caches (the KV rows stay allocated: they are its scheduler row's cache)."""
        self.prefix.clear()
        self.image_cache.clear()

    def cache_bytes(self) -> dict:
        """Memory held: the KV cache (allocated once, max_context rows) and the image embedding cache (bounded)."""
        return {"kv_cache": self.row.cache.nbytes, "image_cache": self.image_cache.bytes,
                "image_cache_limit": self.image_cache.max_bytes, "images_cached": len(self.image_cache)}

    def _media(self, conv: Conversation, cached: bool, max_tiles: int | None,
               max_frames: int | None = None,
               max_patches: int | None = None) -> tuple[list[ImageChunk], list[tuple], int]:
        """Each image's chunk: its embeddings from the image cache (if cached and there), else its tiles; each
        video's (prompt pieces, one chunk per sampled frame, clip); how many images and frames came from the cache."""
        spec = with_max_patches(img_ops.with_max_tiles(self.manifest.image, max_tiles), max_patches)
        images, hits = [], 0
        found = []  # (source, key, cached item): every image's header is read before any is decoded
        for src in conv.images:
            s = read_image(src, self.fetch)
            key = (s.digest, max_tiles, max_patches)
            found.append((s, key, self.image_cache.get(key) if cached else None))
        check_pixels([s for s, _, item in found if item is None], spec, self.fetch.max_pixels)
        for i, (s, key, item) in enumerate(found):
            label = f"image {i + 1}"
            if item is not None:
                hits += 1
                images.append(item.reused(label))
            else:
                tiles = img_ops.preprocess(s.decode(spec, self.fetch.max_pixels), spec)
                tokens = tile_inputs.tile_op(self.manifest.vision).tokens(tiles.patch_grids, len(tiles.pixels),
                                                                          self.manifest)
                images.append(ImageChunk(key, tiles.grid, pixels=tiles.pixels, label=label, tile_tokens=tokens,
                                         patch_grids=tiles.patch_grids, resized_to_fit=tiles.resized_to_fit))
        videos = []
        for j, v in enumerate(conv.videos):
            pieces, frames, clip, h = self._video(v, j, cached, max_frames)
            videos.append((pieces, frames, clip))
            hits += h
        return images, videos, hits

    def _video(self, v: VideoSource, j: int, cached: bool,
               max_frames: int | None) -> tuple[list, list[ImageChunk], object, int]:
        """A video's prompt pieces (its text, None per frame), its sampled frames as one-tile chunks, the clip, and how
        many frames came from the image cache."""
        m = self.manifest
        spec = m.prompt.video
        why = video_refusal(m.prompt)  # before the video's bytes are read
        if why:
            raise video_ops.VideoError(why)
        if max_frames is not None and max_frames < 1:
            raise video_ops.VideoError("--max-frames must be >= 1")
        clip = video_ops.open_source(v.source, v.fps, self.fetch)
        idx = video_ops.sample_indices(clip, spec, max_frames)
        out, hits = [], 0
        for k, im in enumerate(clip.frames(idx)):
            key = video_ops.frame_key(im, spec)
            item = self.image_cache.get(key) if cached else None
            label = f"frame {k + 1} of video {j + 1}"
            if item is not None:
                hits += 1
                out.append(item.reused(label))
            else:
                tiles = video_ops.frame_tiles(im, spec, m.image)
                tokens = None
                if tiles.patch_grids is not None:
                    tokens = tile_inputs.tile_op(m.vision).tokens(tiles.patch_grids, len(tiles.pixels), m)
                out.append(ImageChunk(key, tiles.grid, pixels=tiles.pixels, label=label, tile_tokens=tokens,
                                      patch_grids=tiles.patch_grids))
            out[-1].expansion_params, out[-1].token_id = spec.frame_params or None, spec.frame_token_id
        return video_ops.video_pieces(spec, clip, idx), out, clip, hits

    def _build(self, conv: Conversation, images: list[ImageChunk], videos: list = ()) -> Prompt:
        """The prompt of conv: the rendered template's pieces with each image's and video's text and media."""
        m = self.manifest
        pieces, media = [], []
        for x in self.template.render(conv):
            if isinstance(x, str):
                pieces.append(x)
            elif x[0] == "image":
                pieces.append(None)
                media.append(images[x[1]])
            else:
                pieces += videos[x[1]][0]
                media += videos[x[1]][1]
        return build(pieces, media, m.prompt, self.bundle.tokenizer, m.special_tokens.image_token_id)

    def _frames_that_fit(self, conv: Conversation, images: list[ImageChunk], videos: list) -> int:
        """The most frames per video (max_frames) whose prompt fits the context, 0 if none: the prompts of fewer
        frames tokenized (their text only: nothing is decoded or encoded)."""
        spec, ctx = self.manifest.prompt.video, self.manifest.kv.max_context
        for k in range(max(len(f) for _, f, _ in videos) - 1, 0, -1):
            alt = []
            for _, got, clip in videos:
                idx = video_ops.sample_indices(clip, spec, k)
                f = got[0]  # (a clip's frames are of one size: the same tokens each)
                frames = [ImageChunk(None, f.grid, label="frame", tile_tokens=f.tile_tokens,
                                     expansion_params=f.expansion_params, token_id=f.token_id) for _ in idx]
                alt.append((video_ops.video_pieces(spec, clip, idx), frames, clip))
            if self._build(conv, images, alt).n_tokens < ctx:
                return k
        return 0

    def _overflow(self, prompt: Prompt, grids: list, conv: Conversation, images: list, videos: list) -> ContextOverflow:
        m, n = self.manifest, prompt.n_tokens
        ctx = m.kv.max_context
        if videos:
            frames = sum(len(f) for _, f, _ in videos)
            tokens = next(c.n_tokens for c in prompt.chunks if getattr(c, "label", "").startswith("frame"))
            fit = self._frames_that_fit(conv, images, videos)
            what = "video + prompt" if len(videos) == 1 else f"{len(videos)} videos + prompt"
            fix = f"sample fewer frames (--max-frames {fit}, or \"max_frames\" in a request) or " if fit else ""
            return ContextOverflow(f"{what} is {n} tokens ({frames} frames of {tokens} tokens each) but the bundle's "
                                   f"max context is {ctx}; {fix}re-export with a larger --max-seq-len")
        tiles = [g[2] for g in grids]
        fix = "re-export with a larger --max-seq-len"
        if grids and "max_tiles" in m.image.params and max(tiles) > 1:
            fix = "use fewer tiles (--max-tiles) or " + fix
        if len(grids) > 1:
            fix = "use fewer images, " + fix
        what = {0: "prompt", 1: "image + prompt"}.get(len(grids), f"{len(grids)} images + prompt")
        per = f" (tiles per image: {', '.join(map(str, tiles))}; {m.prompt.tokens_per_tile} tokens per tile)" if grids else ""
        return ContextOverflow(f"{what} is {n} tokens{per} but the bundle's max context is {ctx}; {fix}")

    # --- an answer: prepare, encode, then its sequence's ids streamed as text (runtime/answers.py runs them) ---
    def _run(self, prepare) -> Iterator[str]:
        """One answer (prepare(): its Answer, made at the first step: generate / chat raise on bad input when
        iterated) through an AnswerLoop of this VLM alone: the rounds of its scheduler until it ends; a failure raises
        here."""
        from .answers import AnswerLoop

        a = prepare()
        loop = AnswerLoop([self])
        loop.begin(a)
        try:
            while loop.busy:
                for _, kind, value in loop.round():
                    if kind == "error":
                        raise value
                    if kind == "piece":
                        yield value
                        self._still_mine(a.me)  # before the next step writes a KV row another answer may own
        finally:
            loop.cancel(self.slot)  # (an answer closed, or failed, before its end: its sequence leaves the row)

    def prepare(self, conv: Conversation, cached: bool, mode, max_new_tokens, sampling, ignore_eos, max_tiles,
                stop, max_frames=None, max_patches=None, response_format=None, logprobs=None) -> "Answer":
        """An answer's host side up to the vision graph: options checked, the response format's grammar compiled,
        images and videos read and tiled (or found in the image cache if cached), the prompt built and checked against
        the context, the cache rows it may keep (cached: chat's prefix reuse). Raises on bad input (GrammarError for
        the response format); nothing is encoded or decoded yet. self.result is its."""
        m = self.manifest
        mode = mode or m.generate.get("default_mode", "hybrid")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral):
            raise TypeError(f"max_new_tokens must be an integer, not {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, Integral)
                                     or not 0 <= logprobs <= MAX_TOP):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP}] (the top tokens to list), "
                             f"not {logprobs!r}")
        sampler, cut = Sampler(sampling), StopStrings(stop)
        spec = response_format if isinstance(response_format, (GrammarSpec, type(None))) else \
            GrammarSpec.from_response_format(response_format)
        constraint = None if spec is None else self.grammars.constraint(spec)
        self._answers += 1
        res = self.result = Result()
        a = Answer(self._answers, self.slot, cached, mode, max_new_tokens, sampler, ignore_eos, cut, res, time.perf_counter(),
                   logprobs, constraint=constraint)
        if logprobs is not None:
            res.logprobs = []
            self._token_bytes = self._token_bytes or TokenBytes(self.bundle.tokenizer)
        st = res.stats
        st.load_s = self.load_s
        st.grammar_compile_s = 0.0 if constraint is None else constraint.compile_s

        images, videos, st.images_cached = self._media(conv, cached, max_tiles, max_frames, max_patches)
        media = images + [f for _, frames, _ in videos for f in frames]
        grids = [x.grid for x in media]
        st.images, st.image_tiles = len(media), sum(g[2] for g in grids)
        st.images_resized = sum(m.resized_to_fit for m in images)
        st.videos, st.video_frames = len(videos), sum(len(f) for _, f, _ in videos)
        a.prompt = prompt = self._build(conv, images, videos)
        res.prompt_ids = ids = prompt.ids
        st.prompt_tokens = len(ids)
        if len(ids) >= m.kv.max_context:
            raise self._overflow(prompt, grids, conv, images, videos)
        a.keys = prompt.keys()
        a.start = self.row.reusable(mode, min(self.prefix.common(a.keys), len(ids) - 1)) if cached else 0
        st.reused_prompt_tokens = a.start
        a.media = bool(media)
        st.preprocess_s = time.perf_counter() - a.t0
        return a

    def encode(self, a: "Answer") -> Iterator[None]:
        """The answer's image rows (from the image cache, from the vision graph, or none for an image wholly inside
        the kept prefix), one vision call (one tile) per step: yields after each but the last (so that the others'
        decode steps go on between them); then its Sequence (a.seq) with the prompt's embeddings, positions and row
        input, ready to admit."""
        st = a.res.stats
        lazy0, encode_s = self.lazy_load_s, 0.0
        todo = [c for c in a.prompt.needs_rows(a.start) if c.embeds is None]
        calls = sum(len(c.pixels) for c in todo)
        t1 = time.perf_counter()
        for c in todo:
            for _ in self._encode_tiles(c, a.cached):
                calls -= 1
                if calls:  # (after the last call the prompt's first prefill block follows at once)
                    encode_s += time.perf_counter() - t1
                    yield
                    t1 = time.perf_counter()
        embeds = PromptRows(a.prompt, self.scheduler.embed, a.start)  # a block's rows at a time, as it prefills
        st.vision_load_s = self.lazy_load_s - lazy0
        st.vision_s = encode_s + time.perf_counter() - t1 - st.vision_load_s
        st.vision_skipped = a.media and not todo
        positions, rows, spans = self._positions_rows(a.prompt, a.start)
        a.seq = Sequence(embeds, a.mode, a.max_new_tokens, a.sampler, a.ignore_eos, a.start, a.prompt.ids, positions,
                         rows, constraint=a.constraint, logprobs=a.logprobs, spans=spans)

    def admit(self, a: "Answer") -> None:
        """The answer's sequence onto this VLM's row of its scheduler (an answer of this VLM left unfinished there by
        a caller that began another leaves it)."""
        old = self.scheduler.seqs[self.slot]
        if old is not None:
            self.scheduler.remove(old)
        if a.cached:
            self.prefix.clear()  # the cache's rows change from here on; record() says what they hold at the end
        self.scheduler.add(a.seq, self.slot)
        a.recording = a.cached

    def stream(self, a: "Answer", ids: list[int]) -> Iterator[str]:
        """Text pieces of the answer's new ids (stop strings held back and cut: a.cut.stopped then; later ids are
        dropped)."""
        res, tok = a.res, self.bundle.tokenizer
        for token in ids:
            if a.cut.stopped:
                return
            if not res.token_ids:
                res.stats.ttft_s = time.perf_counter() - a.t0
            if res.logprobs is not None:  # (the sequence's entry for this id: the ids come in its order)
                res.logprobs.append(self._spelled(a.seq.token_logprobs[len(res.token_ids)]))
            res.token_ids.append(token)
            piece = a.decode.step(tok, token)
            if token in self._kept:
                piece = (piece or "") + self._kept[token]
            if piece:
                a.fed += piece
                out = a.cut.feed(piece)
                if out:
                    yield out

    def _decoded(self, ids: list[int]) -> str:
        """ids' text, special tokens left out but the kept ones (self._kept)."""
        tok, out, start = self.bundle.tokenizer, [], 0
        for i, t in enumerate(ids):
            if t in self._kept:
                out += [tok.decode(ids[start:i], skip_special_tokens=True), self._kept[t]]
                start = i + 1
        return "".join(out) + tok.decode(ids[start:], skip_special_tokens=True)

    def _spelled(self, e: TokenLogprob) -> TokenLogprob:
        """e and its top tokens with their text and bytes (TokenBytes)."""
        tb = self._token_bytes
        for x in (e, *e.top):
            x.bytes, x.token = tb.bytes(x.id), tb.text(x.id)
        return e

    def release(self, a: "Answer", done: bool) -> None:
        """The answer is over (done: it ended, or a stop string ended it; else it failed or was closed): the prefix
        cache records what the row's rows hold, where they are still its."""
        if a.recording and (done or a.res.token_ids) and self._answers == a.me:
            self.prefix.record(a.keys + a.res.token_ids)
        a.recording = False

    def finish(self, a: "Answer") -> Iterator[str]:
        """The answer's last pieces (text DecodeStream held back, stop strings' flush) and its Result's text and stats."""
        self.release(a, True)
        res, st, cut = a.res, a.res.stats, a.cut
        # DecodeStream holds back an incomplete UTF-8 sequence; flush what the full decode has beyond it
        full = self._decoded(res.token_ids)
        if not cut.stopped and full.startswith(a.fed) and len(full) > len(a.fed):
            out = cut.feed(full[len(a.fed):])
            if out:
                yield out
        out = cut.flush()
        if out:
            yield out
        res.text = cut.text if (cut.stopped or full.startswith(a.fed)) else full
        g = a.seq.stats
        st.generated_tokens = len(res.token_ids)
        st.prefill_s = g.prefill_s
        st.prefill_tokens_per_s = g.prefill_tokens_per_s
        st.decode_tokens_per_s = g.decode_tokens_per_s
        st.drafted_tokens, st.accepted_tokens = g.drafted_tokens, g.accepted_tokens
        st.state_snapshots, st.snapshot_ms = g.state_snapshots, 1000 * g.snapshot_s
        st.state_replays, st.replay_ms = g.state_replays, 1000 * g.replay_s
        st.decode_ms_per_token = 1000 * g.decode_s / max(1, len(res.token_ids) - 1)
        st.stop_reason = "stop" if cut.stopped else g.stop_reason
        st.total_s = time.perf_counter() - a.t0
        st.peak_rss_mb = peak_rss_mb()

    def _still_mine(self, me: int) -> None:
        if self._answers != me:
            raise RuntimeError("this answer cannot go on: the VLM began another one (generate / chat) since, over the "
                               "same KV cache; a VLM answers one request at a time (use one VLM per concurrent answer)")

    def __call__(self, prompt: str, image=None, **kw) -> Result:
        for _ in self.generate(prompt, image, **kw):
            pass
        return self.result
