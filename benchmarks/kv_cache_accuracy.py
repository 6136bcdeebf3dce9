"""The quantized KV cache's accuracy after long prompts: teacher-forced top-1 agreement and mean KL of bundles against
a reference bundle of the same weights (`vlmrt export --kv-cache int8|int4` against fp32), after prompts of each
length.

    python -m benchmarks.kv_cache_accuracy REF BUNDLE [BUNDLE ...] [--lengths 128,1000,4000] [--tokens 64]
    python -m benchmarks.kv_cache_accuracy REF BUNDLE --images a.png,b.png,c.png   # a VLM bundle, many-image prompts

The text is the repository's own docs (docs/*.md, real English and tables, as they are at the commit run: compare
bundles within one run), tokenized once; for each length L the
prompt is its first L tokens at an offset, the next `tokens` tokens are teacher-forced (CacheRow.score: prefill in
the bundle's blocks, then one decode step per token), and each bundle's logits at those positions are compared with
the reference's (eval/metrics.py compare_logits). Several windows per length (--windows) at different offsets.
With --images, each prompt is the bundle's chat template over those images and then the text (VLM.prompt, the
images' rows from the bundle's own vision graph), the text cut so that the whole prompt is about L tokens; the
teacher-forced tokens are the text's next ones. Prints one markdown row per bundle and length.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vlmrt.eval.metrics import compare_logits
from vlmrt.runtime.vlm import VLM


def text_ids(vlm: VLM) -> list[int]:
    docs = sorted(Path(__file__).resolve().parents[1].glob("docs/*.md"))
    return vlm.bundle.tokenizer.encode("\n\n".join(p.read_text() for p in docs), add_special_tokens=False).ids


def score(vlm: VLM, ids: list[int], n: int, tokens: int, images: list[str]) -> tuple[np.ndarray, int]:
    """(logits of the teacher-forced tokens after a prompt of about n tokens, the prompt's tokens)."""
    vlm.row.cache.reset()
    if not images:
        return vlm.row.score(vlm.scheduler.embed(ids[:n]), ids[n:n + tokens]), n
    media = vlm.media(images)
    m = max(1, n - vlm.prompt("", images, media=media).n_tokens)  # the text's share of the prompt
    p = vlm.prompt(vlm.bundle.tokenizer.decode(ids[:m]), images, media=media)
    x = vlm.decoder_inputs(p)
    vlm.row.cache.reset()
    return vlm.row.score(x.embeds, ids[m:m + tokens], positions=x.positions, rows=x.rows), p.n_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--lengths", default="128,1000,4000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--images", default="", help="comma-separated images before the text (a VLM bundle)")
    a = ap.parse_args()
    images = [x for x in a.images.split(",") if x]
    ref = VLM.load(a.ref)
    ids = text_ids(ref)
    lengths = [int(x) for x in a.lengths.split(",")]
    stride = (len(ids) - max(lengths) - a.tokens) // max(1, a.windows)
    windows = [ids[w * stride:] for w in range(a.windows)]
    refs = {(n, w): score(ref, win, n, a.tokens, images) for n in lengths for w, win in enumerate(windows)}
    print(f"text: {len(ids)} tokens of docs/*.md; {a.windows} windows x {a.tokens} teacher-forced tokens per length; "
          f"images: {len(images)}")
    print("| bundle | prompt tokens | top-1 | mean KL |")
    print("|---|---|---|---|", flush=True)
    for b in a.bundles:
        vlm = VLM.load(b)
        for n in lengths:
            agree = kl = count = 0
            for w, win in enumerate(windows):
                got, n_prompt = score(vlm, win, n, a.tokens, images)
                c = compare_logits(refs[n, w][0], got)
                agree, kl, count = agree + c["agree_count"], kl + c["kl_sum"], count + c["positions"]
            print(f"| {Path(b).name} | {n_prompt} | {agree / count:.4f} | {kl / count:.4f} |", flush=True)
        del vlm


if __name__ == "__main__":
    main()
