"""Structured output's cost (docs/performance.md "Structured output"): decode tokens/s with a JSON schema against
without at 1 and 8 concurrent streams on a bundle (default: the demo model), the per-token mask time at a tokenizer's
vocabulary (the Qwen3 tokenizer's 151k, and a 262k one made from it by adding unreachable vocabulary entries, the
Gemma shape), a thread hop's cost (what overlapping the mask with the decoder call would pay), and grammar compile
times of a small and a deep schema.

    python -m benchmarks.grammar_decode [BUNDLE] [--tokens 64] [--rounds 3] [--tokenizer ../shared/assets/qwen3-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# a long string: every answer runs the same --tokens (as ignore_eos does without the schema), under a mask each step
LONG = {"type": "object", "properties": {"description": {"type": "string", "minLength": 2000}},
        "required": ["description"], "additionalProperties": False}
WALK = {"type": "object", "properties": {"shape": {"enum": ["circle", "rectangle", "triangle"]},
                                         "color": {"type": "string"}, "size": {"type": "integer"},
                                         "description": {"type": "string"}},
        "required": ["shape", "color", "size", "description"], "additionalProperties": False}
WALK_TEXT = json.dumps({"shape": "circle", "color": "dark red", "size": 42,
                        "description": "a red circle on a white background, slightly to the left, with a thin shadow "
                                       "under it and a small blue square in the corner"}, separators=(",", ":"))
SMALL = {"type": "object", "properties": {"shape": {"enum": ["circle", "rectangle", "triangle"]},
                                          "color": {"type": "string", "maxLength": 16}},
         "required": ["shape", "color"], "additionalProperties": False}


def deep(levels: int = 8, width: int = 6) -> dict:
    """Objects nested levels deep, width properties each (strings, integers with bounds, enums, arrays, anyOf)."""
    node: dict = {"type": "object", "properties": {"leaf": {"type": "string", "pattern": "^[a-z]{2,8}$"}}}
    for d in range(levels):
        props = {f"s{d}_{i}": {"type": "string", "maxLength": 40} for i in range(width // 2)}
        props.update({f"n{d}_{i}": {"type": "integer", "minimum": -5, "maximum": 1000} for i in range(width // 3)})
        props[f"e{d}"] = {"enum": [f"v{j}" for j in range(12)]}
        props[f"a{d}"] = {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
                          "maxItems": 8}
        props[f"child{d}"] = node
        node = {"type": "object", "properties": props, "required": sorted(props)[: width // 2],
                "additionalProperties": False}
    return node


def streams(bundle: str, n: int, tokens: int, arms: dict, rounds: int) -> dict:
    """n answers at once through VLM.slots (one batched decoder call a round) per arm (name -> GrammarSpec or None),
    the arms interleaved round by round (a first round warms up: sessions, each grammar's compile); per arm the
    medians over rounds of the wall-clock tokens/s and of the answers' mean decode tokens/s (each answer's
    decode_tokens_per_s: its tokens after the first over its decode time) and ms per decode step."""
    from vlmrt.runtime.answers import AnswerLoop
    from vlmrt.runtime.bundle import Bundle
    from vlmrt.runtime.vlm import VLM

    vlms = VLM.slots(Bundle.open(bundle), n) if n > 1 else [VLM.load(bundle)]
    loop = AnswerLoop(vlms)
    got: dict = {name: [] for name in arms}
    for r in range(rounds + 1):
        for name, fmt in arms.items():
            msgs = [[{"role": "user", "content": f"Describe shape number {i + r} in detail."}] for i in range(n)]
            t = time.perf_counter()
            for v, m in zip(vlms, msgs):
                v.reset()
                loop.begin(v.chat_answer(m, max_new_tokens=tokens, ignore_eos=fmt is None, response_format=fmt))
            done = []
            while loop.busy:
                done += [value for _, kind, value in loop.round() if kind == "done"]
            wall = time.perf_counter() - t
            if r:
                gen = sum(x.stats.generated_tokens for x in done)
                got[name].append({"tokens": gen, "wall_tok_s": gen / wall,
                                  "decode_tok_s": statistics.mean(x.stats.decode_tokens_per_s for x in done),
                                  "stop": sorted({x.stats.stop_reason for x in done})})
    return {name: {"tokens": runs[0]["tokens"], "stop": runs[0]["stop"],
                   "wall_tok_s": round(statistics.median(x["wall_tok_s"] for x in runs), 2),
                   "decode_tok_s": round(statistics.median(x["decode_tok_s"] for x in runs), 2),
                   "decode_ms_per_step": round(1000 / statistics.median(x["decode_tok_s"] for x in runs), 2)}
            for name, runs in got.items()}


def synth_262k(src: Path, out: Path, size: int = 262144) -> Path:
    """The tokenizer at src with vocabulary entries added (byte-level strings of 3-9 characters, never produced by
    its merges) up to size ids: llguidance's token trie at the Gemma shape."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    have = len(vocab) + len(tok.get("added_tokens", []))
    alphabet = [chr(c) for c in range(0x21, 0x7f)] + ["Ġ", "Ċ"]
    rng = np.random.default_rng(0)
    nxt, taken = max(vocab.values()) + 1 + len(tok.get("added_tokens", [])), set(vocab)
    while have < size:
        s = "".join(rng.choice(alphabet, rng.integers(3, 10)))
        if s in taken:
            continue
        taken.add(s)
        vocab[s] = nxt
        nxt += 1
        have += 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def mask_time(folder: Path, eos: int, text: str, schema: dict, reps: int = 20) -> dict:
    """Per token of text under schema: the mask (llguidance), the greedy pick's fast path (the argmax allowed: a bit
    test), its slow path (the masked argmax over the vocabulary), a sampled pick (the masked row through the sampler)
    and the matcher's advance; medians over reps walks, microseconds."""
    import tokenizers

    from vlmrt.runtime.decode.grammar import Grammars, GrammarSpec
    from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig

    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    t = time.perf_counter()
    g = Grammars(tok, vocab, [eos])
    g._tokenizer()
    tok_s = time.perf_counter() - t
    spec = GrammarSpec.json_schema(schema)
    ids = tok.encode(text, add_special_tokens=False).ids
    logits = np.random.default_rng(1).standard_normal(vocab).astype(np.float32)
    greedy, sample = Sampler(SamplingConfig()), Sampler(SamplingConfig(temperature=0.8, top_p=0.95, seed=1))
    parts = {"mask": [], "fast_pick": [], "masked_argmax": [], "sampled_pick": [], "advance": []}
    for _ in range(reps):
        c = g.constraint(spec)
        for token in ids:
            a = time.perf_counter()
            c.compute_mask()
            b = time.perf_counter()
            c.pick(greedy, logits, token)  # the graph's argmax is the allowed token: the fast path
            d = time.perf_counter()
            parts["mask"].append(b - a)
            parts["fast_pick"].append(d - b)
            if len(parts["masked_argmax"]) < 200:
                e = time.perf_counter()
                c.pick(greedy, logits, None if c.allows(int(np.argmax(logits))) else int(np.argmax(logits)))
                f = time.perf_counter()
                c.pick(sample, logits)
                h = time.perf_counter()
                parts["masked_argmax"].append(f - e)
                parts["sampled_pick"].append(h - f)
            e = time.perf_counter()
            assert c.accept(token)
            parts["advance"].append(time.perf_counter() - e)
    free, free_sampled = [], []
    for _ in range(200):
        a = time.perf_counter()
        int(np.argmax(logits))
        b = time.perf_counter()
        sample(logits)
        free.append(b - a)
        free_sampled.append(time.perf_counter() - b)
    return {"vocab": vocab, "tokens_per_walk": len(ids), "tokenizer_build_s": round(tok_s, 3),
            **{k + "_us": round(1e6 * statistics.median(v), 1) for k, v in parts.items()},
            "mask_p99_us": round(1e6 * float(np.percentile(parts["mask"], 99)), 1),
            "unconstrained_argmax_us": round(1e6 * statistics.median(free), 1),
            "unconstrained_sampled_us": round(1e6 * statistics.median(free_sampled), 1)}


def compile_times(folder: Path, eos: int) -> dict:
    import tokenizers

    from vlmrt.runtime.decode.grammar import Grammars, GrammarSpec

    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    g = Grammars(tok, tok.get_vocab_size(), [eos])
    g._tokenizer()
    out = {}
    for name, schema in (("small", SMALL), ("deep", deep())):
        spec = GrammarSpec.json_schema(schema)
        first = g.constraint(spec).compile_s
        t = time.perf_counter()
        g.constraint(spec)
        out[name] = {"schema_bytes": len(json.dumps(schema)), "compile_ms": round(1000 * first, 2),
                     "cached_ms": round(1000 * (time.perf_counter() - t), 3)}
    return out


def thread_hop(reps: int = 2000) -> float:
    """Median microseconds of submitting a no-op to a one-thread pool and waiting for it."""
    pool, ts = ThreadPoolExecutor(1), []
    for _ in range(reps):
        t = time.perf_counter()
        pool.submit(int).result()
        ts.append(time.perf_counter() - t)
    pool.shutdown()
    return round(1e6 * statistics.median(ts), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None, help="default: the demo model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", default="../shared/assets/qwen3-tokenizer",
                    help="a folder with a tokenizer.json of about 151k tokens (default: the Qwen3 tokenizer of "
                         "../shared/ASSETS.md, from the main checkout)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    from vlmrt.demo.default_model import ensure_bundle
    from vlmrt.runtime.decode.grammar import GrammarSpec

    bundle = a.bundle or str(ensure_bundle(progress=False))
    res: dict = {"bundle": bundle, "cpu": os.cpu_count(), "load_before": os.getloadavg()}
    arms = {"free": None, "json_long_string": GrammarSpec.json_schema(LONG), "json_small": GrammarSpec.json_schema(SMALL)}
    for n in (1, 8):
        res[f"{n}_streams"] = r = streams(bundle, n, a.tokens, arms, a.rounds)
        print(n, r, flush=True)
    qwen = Path(a.tokenizer)
    res["mask_151k"] = mask_time(qwen, 151645, WALK_TEXT, WALK)
    print("151k", res["mask_151k"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        big = synth_262k(qwen, Path(tmp))
        res["mask_262k"] = mask_time(big, 151645, WALK_TEXT, WALK)
        print("262k", res["mask_262k"], flush=True)
    res["compile_151k"] = compile_times(qwen, 151645)
    print("compile", res["compile_151k"], flush=True)
    res["thread_hop_us"] = thread_hop()
    res["load_after"] = os.getloadavg()
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
