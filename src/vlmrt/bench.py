"""`vlmrt bench`: repeatable timings of one bundle, min / median / max over runs.

Each run times model load (fresh sessions: VLM.load, plus the vision session that the first image loads), image preprocessing, vision encode, prefill (time to
first token from the start of the request) and decode (exactly --gen-tokens tokens, EOS ignored,
so that runs compare), the host (Python) time per decode step outside the graph call, and the
process's peak RSS. The prompt is the sample image (if any) plus a text padded to --prompt-tokens
tokens in total.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from .runtime.sessions import default_threads
from .runtime.vlm import VLM, peak_rss_mb

FILLER = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "


def make_prompt(vlm: VLM, image, prompt_tokens: int) -> str:
    """A text whose full templated prompt (with the image, if any) is at most prompt_tokens tokens, as close as words allow."""
    images = [image] if image else []
    media = vlm.media(images)

    def n_tokens(text: str) -> int:
        return vlm.prompt(text, images, media=media).n_tokens

    text = ""
    least = n_tokens(text)
    if least > prompt_tokens:
        raise ValueError(f"--prompt-tokens {prompt_tokens} is less than the {'image + ' if image else ''}chat template "
                         f"alone ({least} tokens)")
    for word in (FILLER * (prompt_tokens // 8 + 1)).split():
        if n_tokens(text + word + " ") > prompt_tokens:
            break
        text += word + " "
    return text


def summarize(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def bench(path: str | Path, *, image=None, prompt_tokens: int = 256, gen_tokens: int = 64, runs: int = 3,
          threads: int | None = None, mode: str = "hybrid", device: str = "cpu", lookahead: int = 0) -> dict:
    rows = []
    prompt = None
    for _ in range(runs):
        t = time.perf_counter()
        vlm = VLM.load(path, device=device, threads=threads, verify=False, lookahead=lookahead)
        load = time.perf_counter() - t
        if prompt is None:
            ctx = vlm.manifest.kv.max_context
            if prompt_tokens + gen_tokens > ctx:  # else a run stops at the context, short of --gen-tokens
                raise ValueError(f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} is more than the bundle's "
                                 f"max context ({ctx} tokens)")
            prompt = make_prompt(vlm, image, prompt_tokens)
        r = vlm(prompt, image, mode=mode, max_new_tokens=gen_tokens, ignore_eos=True)
        s, g = r.stats, vlm.scheduler.last
        rows.append({"load_s": load + s.vision_load_s, "preprocess_s": s.preprocess_s, "vision_s": s.vision_s, "ttft_s": s.ttft_s,
                     "prefill_tokens_per_s": s.prefill_tokens_per_s, "decode_ms_per_token": s.decode_ms_per_token,
                     "decode_tokens_per_s": s.decode_tokens_per_s,
                     "host_overhead_ms_per_step": vlm.scheduler.last.host_overhead_ms_per_step,
                     "accepted_per_draft": g.accepted_tokens / g.drafted_tokens if g.drafted_tokens else 0.0,
                     "prompt_tokens": s.prompt_tokens, "image_tiles": s.image_tiles,
                     "generated_tokens": s.generated_tokens})
        del vlm, r, g  # before the next load: the peak RSS is one loaded model's, not two
        gc.collect()
    keys = [k for k in rows[0] if k not in ("prompt_tokens", "generated_tokens", "image_tiles")]
    return {
        "bundle": str(path), "mode": mode, "lookahead": lookahead, "device": device, "threads": threads or default_threads(), "runs": runs,
        "image": str(image) if image else None, "prompt_tokens": rows[0]["prompt_tokens"],
        "generated_tokens": rows[0]["generated_tokens"], "image_tiles": rows[0]["image_tiles"],
        **{k: summarize([r[k] for r in rows]) for k in keys},
        "peak_rss_mb": peak_rss_mb(),
    }
