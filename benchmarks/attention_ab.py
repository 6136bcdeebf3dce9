"""Two exports of one checkpoint (e.g. --attention portable vs gqa) give the same answers? Greedy ids of 5 text
prompts in both modes (32 tokens, EOS ignored), then teacher-forced logits over the first answer's tokens:
max |logit A - logit B| per prompt and mode, next to A's own kv-vs-hybrid difference (the float noise floor of one
bundle). Usage: python -m benchmarks.attention_ab BUNDLE_A BUNDLE_B"""
import sys

import numpy as np

import vlmrt

PROMPTS = ["Describe the picture in detail.", "What is written here?", "hi", "Write a haiku about the sea.",
           "List five fruits, one per line."]
va, vb = vlmrt.load(sys.argv[1]), vlmrt.load(sys.argv[2])
same = 0
for p in PROMPTS:
    for mode in ("kv", "hybrid"):
        ra = va(p, mode=mode, max_new_tokens=32, ignore_eos=True).token_ids
        rb = vb(p, mode=mode, max_new_tokens=32, ignore_eos=True).token_ids
        part = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
        same += part is None
        print(f"{mode:6s} {p[:32]:32s} {'identical' if part is None else f'part at token {part}'}", flush=True)
print(f"greedy ids: {same}/{2 * len(PROMPTS)} identical")
for p in PROMPTS[:3]:
    ids = va.prompt(p).ids
    answer = va(p, mode="kv", max_new_tokens=24, ignore_eos=True).token_ids
    la = {m: va.row.score(va.scheduler.embed(ids), answer, mode=m) for m in ("kv", "hybrid")}
    for m in ("kv", "hybrid"):
        lb = vb.row.score(vb.scheduler.embed(ids), answer, mode=m)
        print(f"logits {m:6s} {p[:24]:24s} max|A-B| {np.abs(la[m] - lb).max():.3g}   "
              f"A kv vs A hybrid {np.abs(la['kv'] - la['hybrid']).max():.3g}")
