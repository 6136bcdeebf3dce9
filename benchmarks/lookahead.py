"""Decode tokens/s with and without lookahead decoding, side by side: copy-heavy prompts (repeat / reformat a list
given in the prompt) and open-ended ones, greedy, rounds interleaved, medians. Checks that every lookahead answer has
the plain answer's token ids.

    python -m benchmarks.lookahead BUNDLE [--k 0,4,16] [--rounds 3] [--max-new-tokens 160] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics

from vlmrt.runtime.vlm import VLM

PROMPTS = {
    "copy: repeat a list": "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, "
                           "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry.",
    "copy: reformat a list": "Rewrite this as a numbered list, one city per line: Paris, London, Berlin, Madrid, Rome, "
                             "Vienna, Prague, Warsaw, Lisbon, Dublin, Athens, Oslo, Helsinki, Budapest.",
    "copy: a list 3 times": "Repeat this list three times, one item per line: red, orange, yellow, green, blue, purple, "
                            "pink, brown, black, white.",
    "copy: comma-separated": "Write this list on one line, separated by commas:\nhammer\nscrewdriver\nwrench\npliers\n"
                             "saw\ndrill\nchisel\nfile\nclamp\nlevel\nruler\nsandpaper",
    "copy: numbered 2 times": "Write this list twice as a numbered list: Mercury, Venus, Earth, Mars, Jupiter, Saturn, "
                              "Uranus, Neptune.",
    "open: story": "Write a short story about a lighthouse keeper.",
    "open: explain": "Explain why the sky is blue.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--k", default="0,16", help="largest draft lengths, comma-separated (0 = plain decoding)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--mode", default="hybrid")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    ks = [int(k) for k in a.k.split(",")]
    vlms = {k: VLM.load(a.bundle, threads=a.threads, lookahead=k) for k in ks}
    speed = {(p, k): [] for p in PROMPTS for k in ks}
    info = {}
    for _ in range(a.rounds):
        for p, text in PROMPTS.items():
            ids = None
            for k in ks:
                r = vlms[k](text, mode=a.mode, max_new_tokens=a.max_new_tokens)
                if ids is None:
                    ids = r.token_ids
                assert r.token_ids == ids, f"lookahead {k} changed the answer to {p!r}"
                speed[p, k].append(r.stats.decode_tokens_per_s)
                info[p, k] = (len(ids), r.stats.accepted_tokens, r.stats.drafted_tokens)
    print(f"decode tokens/s, median of {a.rounds} interleaved rounds, mode {a.mode}, greedy, <= {a.max_new_tokens} tokens")
    print(f"{'prompt':24s} {'tokens':>6s} " + " ".join(f"{'k=' + str(k):>22s}" for k in ks))
    for p in PROMPTS:
        base = statistics.median(speed[p, ks[0]])
        cells = []
        for k in ks:
            m = statistics.median(speed[p, k])
            _, acc, drafted = info[p, k]
            cells.append(f"{m:7.1f} ({m / base:4.2f}x) {acc:3d}/{drafted:<3d}")
        print(f"{p:24s} {info[p, ks[0]][0]:6d} " + " ".join(f"{c:>22s}" for c in cells))
    print("cells: tok/s (vs the first k) accepted/drafted tokens of the last round")


if __name__ == "__main__":
    main()
