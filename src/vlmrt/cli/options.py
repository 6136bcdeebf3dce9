"""What several commands share: the generation arguments and options, the image (and video) arguments, the
default model, the stats report."""

from __future__ import annotations

import json


def stats_report(r, build=None) -> str:
    """The answer's figures; build: the default model's first-use build (BuildReport), a line of its own."""
    s = r.stats
    lines = [
        f"prompt tokens      {s.prompt_tokens} ({s.images} images, {s.image_tiles} image tiles; "
        f"{s.reused_prompt_tokens} reused)",
        f"generated tokens   {s.generated_tokens} (stop: {s.stop_reason})",
        f"model load         {s.load_s:.3f} s" + (f" (+ vision graph {s.vision_load_s:.3f} s, on first use)"
                                                 if s.vision_load_s else ""),
        f"image preprocess   {s.preprocess_s:.3f} s",
        f"vision encode      {s.vision_s:.3f} s" + (" (skipped: cached)" if s.vision_skipped else ""),
        f"time to 1st token  {s.ttft_s:.3f} s",
        f"prefill            {s.prefill_tokens_per_s:.1f} tokens/s",
        (f"decode             {s.decode_tokens_per_s:.1f} tokens/s ({s.decode_ms_per_token:.1f} ms/token)"
         if s.generated_tokens > 1 else "decode             none (the one token came from prefill)"),
        f"peak RSS           {s.peak_rss_mb:.0f} MB",
    ]
    if s.drafted_tokens:
        lines.insert(-1, f"lookahead          {s.accepted_tokens} of {s.drafted_tokens} drafted tokens accepted")
    if s.state_snapshots or s.state_replays:  # (a recurrent state: Qwen3.5)
        lines.insert(-1, f"recurrent state    {s.state_snapshots} snapshots ({s.snapshot_ms:.1f} ms), "
                         f"{s.state_replays} lookahead calls run again ({s.replay_ms:.1f} ms)")
    if build is not None:
        lines.append(f"first-use build    {build.line()} (the default model, built in a process of its own)")
    return "\n".join(lines)


def _options(a) -> dict:
    """The generation options of `run` and `chat`, checked."""
    from ..runtime.decode.sampler import SamplingConfig

    SamplingConfig(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed).validate()
    if a.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    return dict(mode=a.mode, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos, max_tiles=a.max_tiles, max_frames=a.max_frames,
                max_patches=a.max_patches)


def _grammar_args(r, what: str = "the answer") -> None:
    """--json-schema FILE, --grammar FILE (Lark), --regex RE: the answer held to a grammar (runtime/decode/grammar.py)."""
    g = r.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help=f"{what} is JSON valid against this JSON schema (compact: no whitespace between tokens)")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help=f"{what} follows this Lark grammar (llguidance's dialect: %%json {{...}} takes a schema)")
    g.add_argument("--regex", default=None, metavar="RE", help=f"{what} matches this regular expression")


def logprobs_count(text: str) -> int:
    """--logprobs N: an integer in 0..MAX_TOP (argparse's type: a bad one is a usage error, exit 2)."""
    import argparse

    from ..runtime.decode.logprobs import MAX_TOP

    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_TOP:
        raise argparse.ArgumentTypeError(f"{text!r}: the top tokens to list beside each token, 0 to {MAX_TOP}")
    return n


def _logprobs_arg(r, where: str) -> None:
    r.add_argument("--logprobs", type=logprobs_count, default=None, metavar="N",
                   help="each generated token's log probability and the N (0 to 20) most likely tokens at its place, "
                        "from the model's logits before temperature / top-k / top-p and the grammar's mask "
                        f"(docs/server.md#log-probabilities); {where}")


def logprobs_table(entries) -> str:
    """A result's logprobs (TokenLogprob) as readable lines: position, token (as a JSON string), logprob, then the
    top tokens with theirs."""
    rows = [f"{'#':>4}  {'token':<16} {'logprob':>9}"]
    for i, e in enumerate(entries):
        top = "  ".join(f"{json.dumps(t.token, ensure_ascii=False)} {t.logprob:.4f}" for t in e.top)
        rows.append(f"{i:>4}  {json.dumps(e.token, ensure_ascii=False):<16} {e.logprob:9.4f}" + (f"   top: {top}" if top else ""))
    return "\n".join(rows)


def _grammar(a):
    """The GrammarSpec of --json-schema / --grammar / --regex (None: free text), compiled nowhere yet; a file that
    cannot be read or is not JSON is one error line."""
    from ..runtime.decode.grammar import GrammarSpec

    if a.regex is not None:
        return GrammarSpec("regex", a.regex, param="--regex")
    for opt, path in (("--json-schema", a.json_schema), ("--grammar", a.grammar)):
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{opt} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if opt == "--grammar":
            return GrammarSpec("lark", text, param=f"{opt} {path}")
        return GrammarSpec.json_schema(text, param=f"{opt} {path}")
    return None


def _fetch(a, **limits):
    """The image reading limits of run / chat / batch: --max-pixels (FetchLimits.max_pixels)."""
    import math

    from ..runtime.media.sources import FetchLimits

    if a.max_pixels is None:
        return FetchLimits(**limits)
    if not (math.isfinite(a.max_pixels) and a.max_pixels > 0):
        raise ValueError("--max-pixels must be a number of millions of pixels > 0")
    return FetchLimits(max_pixels=max(1, int(a.max_pixels * 1e6)), **limits)


def _videos(a) -> list:
    """--video (with --fps for a folder of frames) as the turn's VideoSource."""
    from ..runtime.prompt.conversation import VideoSource

    if a.fps is not None and a.video is None:
        raise ValueError("--fps is the frame rate of a --video folder of frames")
    return [VideoSource(a.video, a.fps)] if a.video is not None else []


def _bundle_or_default(bundle: str | None) -> str:
    """The given bundle, or the offline default model (exported into the cache on first use)."""
    return _bundle_and_build(bundle)[0]


def _bundle_and_build(bundle: str | None):
    """(_bundle_or_default's bundle, the figures of the default model's first-use build when this call ran it, else
    None: demo.default_model.BuildReport). The build runs in a process of its own: this one's peak RSS stays its own."""
    if bundle is not None:
        return bundle, None
    from ..demo.default_model import ensure_bundle_report

    out, build = ensure_bundle_report(progress=True)
    return str(out), build


LOOKAHEAD_HELP = ("lookahead decoding of greedy answers: draft up to N tokens per step by prompt lookup and verify "
                  "them in one decoder call (same output; faster when the answer copies the prompt); 0 = off (default)")


SPECIAL_TOKENS_HELP = ("message text's control-token strings (<|im_start|>, <end_of_utterance>, ...) become those "
                       "tokens, as transformers tokenizes them (default: plain text, so text cannot forge a turn; "
                       "docs/conversations.md#control-tokens-in-message-text)")


def _generation_args(r, threads_help: str = "intra-op threads (default: physical cores)") -> None:
    r.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported into $VLMRT_CACHE or "
                        "~/.cache/vlmrt on first use)")
    r.add_argument("--mode", choices=["kv", "hybrid"], default=None, help="kv: prompt through the AR=1 graph; hybrid: AR=N prefill blocks (default)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable): the answer is cut before it and generation ends there")
    r.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    r.add_argument("--max-tiles", type=int, default=None,
                   help="cap each image's tile count (bundles whose tiling has one, e.g. InternVL)")
    r.add_argument("--max-patches", type=int, default=None,
                   help="native-resolution bundles (Qwen2.5-VL, Qwen3-VL): at most this many patches per image (4 per "
                        "image token), below the bundle's vision graph budget; the image is resized to fit")
    r.add_argument("--max-frames", type=int, default=None,
                   help="sample at most this many frames of a video (default: the checkpoint's, e.g. 64 for SmolVLM2, 32 for Gemma 4)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"],
                   help="htp: all graphs on the Qualcomm NPU via the QNN EP (the HTP simulator on x86-64), no CPU fallback")
    r.add_argument("--htp-arch", default=None,
                   help="--device htp: this device's Hexagon arch (e.g. 75, 79); a bundle compiled for another is refused")
    r.add_argument("--no-kv-requant", action="store_true",
                   help="HTP bundles, hybrid mode: reuse prefill's uint8 KV rows as-is in decode (to measure requantization)")
    r.add_argument("--threads", type=int, default=None, help=threads_help)
    r.add_argument("--lookahead", type=int, default=0, metavar="N", help=LOOKAHEAD_HELP)
    r.add_argument("--max-pixels", type=float, default=None, metavar="MP",
                   help="decode at most MP million pixels of one prompt's images, together and each (default 120; "
                        "checked from the headers, before decoding; a large JPEG counts at the size it is decoded to)")


def _image_arg(r) -> None:
    r.add_argument("--image", action="append",
                   help="image: a file, an http(s):// URL or a data:image/...;base64, URI (repeatable: several "
                        "images, in order, before the text)")
    r.add_argument("--video", default=None,
                   help="video (SmolVLM2 and Gemma 4 bundles): an animated GIF / WebP, an mp4 / webm / mkv / mov file (needs "
                        "vlmrt[video]), a folder of numbered frames (with --fps), an http(s):// URL or a data URI; "
                        "put before the images and the text (docs/video.md)")
    r.add_argument("--fps", type=float, default=None, help="the frame rate of a --video folder of frames")
