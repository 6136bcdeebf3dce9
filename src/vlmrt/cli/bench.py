"""`vlmrt bench`: timings of a bundle over repeated runs (vlmrt.bench)."""

from __future__ import annotations

import json

from .options import LOOKAHEAD_HELP


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="timings of a bundle over repeated runs (min / median / max)")
    b.add_argument("bundle")
    b.add_argument("--image", default=None)
    b.add_argument("--prompt-tokens", type=int, default=256, help="total prompt tokens incl. image (default 256)")
    b.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per run, EOS ignored (default 64)")
    b.add_argument("--runs", type=int, default=3)
    b.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    b.add_argument("--mode", choices=["kv", "hybrid"], default="hybrid")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    b.add_argument("--lookahead", type=int, default=0, metavar="N", help=LOOKAHEAD_HELP)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=run)


def run(a) -> int:
    from ..bench import bench

    if a.runs < 1 or a.gen_tokens < 1 or a.prompt_tokens < 1:
        raise ValueError("--runs, --gen-tokens and --prompt-tokens must be >= 1")
    r = bench(a.bundle, image=a.image, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, runs=a.runs,
              threads=a.threads, mode=a.mode, device=a.device, lookahead=a.lookahead)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['bundle']}: {r['prompt_tokens']} prompt tokens, {r['generated_tokens']} generated, {r['runs']} runs, "
          f"mode {r['mode']}, device {r['device']}, threads {r['threads'] or 'default'}, lookahead {r['lookahead']}"
          "   (min / median / max)")
    for k, unit in (("load_s", "s"), ("preprocess_s", "s"), ("vision_s", "s"), ("ttft_s", "s"),
                    ("prefill_tokens_per_s", "tok/s"), ("decode_ms_per_token", "ms"), ("decode_tokens_per_s", "tok/s"),
                    ("host_overhead_ms_per_step", "ms"), ("accepted_per_draft", "")):
        v = r[k]
        print(f"  {k:22s} {v['min']:9.3f} {v['median']:9.3f} {v['max']:9.3f} {unit}")
    print(f"  peak RSS               {r['peak_rss_mb']:.0f} MB")
    return 0
