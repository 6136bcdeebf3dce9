"""Time to first token of a follow-up question about the same image vs the first question (vlm.chat's prefix cache and
image embedding cache), measured side by side: each run is a fresh conversation (new engine, empty caches, same
sessions), first question then follow-up, so both sit under the same machine load; the ratio is per run.

    python -m vlmrt.demo.smollm2 /tmp/ckpt --vision 256m && vlmrt export /tmp/ckpt /tmp/bundle
    python -m benchmarks.chat_ttft /tmp/bundle --image tests/assets/chelsea.png --runs 3
    python -m benchmarks.chat_ttft /tmp/bundle --context-tokens 1000   # the first question after ~1000 tokens of text

Each turn generates exactly --tokens tokens (EOS ignored: a model that ends at once would have no first token to time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from vlmrt.bench import make_prompt
from vlmrt.runtime.vlm import VLM


def one_run(vlm: VLM, image: str, mode: str, tokens: int, context: str = "") -> dict:
    fresh = VLM(vlm.bundle)  # empty caches, the loaded sessions
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": context + "Can you describe this image?"}]}]
    first = "".join(fresh.chat(msgs, mode=mode, max_new_tokens=tokens, ignore_eos=True))
    s1 = fresh.result.stats
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "What colour is the animal's fur?"}]
    "".join(fresh.chat(msgs, mode=mode, max_new_tokens=tokens, ignore_eos=True))
    s2 = fresh.result.stats
    return {"first_ttft_s": s1.ttft_s, "first_vision_s": s1.vision_s, "first_prompt_tokens": s1.prompt_tokens,
            "image_tiles": s1.image_tiles, "followup_ttft_s": s2.ttft_s, "followup_prompt_tokens": s2.prompt_tokens,
            "followup_reused_tokens": s2.reused_prompt_tokens, "followup_vision_skipped": s2.vision_skipped,
            "ratio": s2.ttft_s / s1.ttft_s, "caches": fresh.cache_bytes()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--image", default="tests/assets/chelsea.png")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", default="hybrid", choices=["kv", "hybrid"])
    ap.add_argument("--tokens", type=int, default=32, help="answer tokens per turn (default 32)")
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="pad the first question with text to about this many prompt tokens (default 0: no padding)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    vlm = VLM.load(a.bundle, threads=a.threads)
    if a.tokens < 1 or a.runs < 1:
        print("error: --tokens and --runs must be >= 1", file=sys.stderr)
        return 2
    context = make_prompt(vlm, a.image, a.context_tokens) if a.context_tokens else ""
    runs = [one_run(vlm, a.image, a.mode, a.tokens, context) for _ in range(a.runs)]
    if a.json:
        print(json.dumps(runs))
        return 0
    for i, r in enumerate(runs):
        print(f"run {i + 1}: first {r['first_ttft_s']:.3f} s ({r['first_prompt_tokens']} prompt tokens, {r['image_tiles']} "
              f"tiles, vision {r['first_vision_s']:.3f} s) | follow-up {r['followup_ttft_s']:.3f} s "
              f"({r['followup_prompt_tokens']} prompt tokens, {r['followup_reused_tokens']} reused, vision skipped: "
              f"{r['followup_vision_skipped']}) | ratio {100 * r['ratio']:.1f} %")
    print(f"median ratio {100 * statistics.median(r['ratio'] for r in runs):.1f} %; caches {runs[-1]['caches']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
