"""One batched decoder call advancing B sequences vs B one-row calls, and whether the batched logits are bit-identical.

    python -m benchmarks.batch_step BUNDLE [--batches 1,2,4,8,16] [--threads 2] [--reps 10] [--steps 24]

BUNDLE: a gqa_in_place CPU bundle. Its decoder graph is given the batch dimension (export/batch_dim.py; a bundle
exported since keeps that graph) in a temporary copy; both graphs run with I/O binding over [B, kv_heads, max_context,
head_dim] buffers. Timing: B sequences at cache length --pos, one call of B rows vs B calls of one row (the original
graph), min and median over reps, interleaved. Identity: B different prompts are prefilled alone (the one-sequence
Engine), then --steps decode steps run both ways with the same tokens (teacher forcing: each sequence fed its
one-row greedy token), and the batched logits are compared with the one-row ones: max |diff|, the first step whose
argmax differs. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import vlmrt  # noqa: F401,E402  (first: it turns onnxruntime's telemetry off before onnxruntime is imported)
import onnxruntime as ort

from vlmrt.export.batch_dim import add_batch_dim
from vlmrt.runtime.vlm import VLM

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Why is the sky blue?", "Name a famous painter.", "What is 12 times 7?", "Describe a cat in one line.",
           "Tell me a joke about computers.", "What is photosynthesis?", "Translate 'hello' into Spanish.",
           "Who wrote Hamlet?", "Give me a synonym of happy.", "What does a CPU do?", "How many legs has a spider?",
           "What colour is grass?", "Say something kind."]


def batched_graph(bundle: Path, out: Path) -> Path:
    if json.loads((bundle / "manifest.json").read_text())["decoder"]["kind"].get("batched"):
        return bundle / "decoder.onnx"  # exported since continuous batching: the graph already takes a batch
    for f in bundle.iterdir():
        if f.name != "decoder.onnx":
            os.link(f.resolve(), out / f.name)  # (ORT refuses external data through a link out of the folder)
    m = onnx.load(str(bundle / "decoder.onnx"), load_external_data=False)
    add_batch_dim(m, "seqlens_k")
    onnx.save(m, str(out / "decoder.onnx"))
    return out / "decoder.onnx"


class Caller:
    """A decoder session bound over cache buffers [B, kv_heads, ctx, head_dim] for B sequences of one token each."""

    def __init__(self, sess, man, B: int, cache: list[np.ndarray] | None = None):
        dec, kv = man.decoder, man.kv
        self.s, self.B = sess, B
        L = kv.attention()
        self.cache = cache if cache is not None else [np.zeros((B, l.kv_heads, kv.max_context, l.head_dim), np.float32)
                                                      for l in L for _ in (0, 1)]
        self.embeds = np.zeros((B, dec.hidden_size), np.float32)
        self.pos = np.zeros((1, B), np.int64)
        self.seqlens = np.zeros(B, np.int32)
        self.total = np.zeros((), np.int32)
        self.rows = np.arange(B, dtype=np.int64)
        self.token_rows = np.zeros((B, dec.hidden_size), np.int8)
        self.token_scales = np.zeros(B, np.float32)
        self.logits = np.zeros((B, dec.vocab_size), np.float32)
        self.argmax = np.zeros(B, np.int64)
        io = self.io = sess.io_binding()
        self.keep = []

        def bind(name, a, out=False):
            v = ort.OrtValue.ortvalue_from_numpy(a)
            self.keep.append(v)
            (io.bind_ortvalue_output if out else io.bind_ortvalue_input)(name, v)
            return v

        names = {i.name for i in sess.get_inputs()}
        for n, a in (("inputs_embeds", self.embeds), ("position_ids", self.pos), ("seqlens_k", self.seqlens),
                     ("total_sequence_length", self.total), ("logit_rows", self.rows),
                     ("token_rows", self.token_rows), ("token_scales", self.token_scales)):
            if n in names:
                bind(n, a)
        bind("logits", self.logits, True)
        bind("next_token", self.argmax, True)
        outs = [o.name for o in sess.get_outputs() if o.name.startswith("present")]
        ins = [i.name for i in sess.get_inputs() if i.name.startswith("past")]
        for i, o, buf in zip(ins, outs, self.cache):
            io.bind_ortvalue_output(o, bind(i, buf))

    def __call__(self, embeds, lengths):
        self.embeds[...] = embeds
        self.pos[0] = lengths
        self.seqlens[:] = lengths
        self.total[...] = max(lengths) + 1
        self.s.run_with_iobinding(self.io)
        return self.logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pos", type=int, default=100)
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args()
    bundle = Path(a.bundle)
    batches = [int(b) for b in a.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(dir=bundle.parent))
    try:
        path = batched_graph(bundle, tmp)
        vlm = VLM.load(bundle, threads=a.threads, verify=False)
        man = vlm.manifest
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
        batched = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        one = vlm.row.sessions.decode
        hidden = man.decoder.hidden_size
        rng = np.random.default_rng(0)
        res = {"bundle": str(bundle), "threads": a.threads, "cpu": next((ln.split(":", 1)[1].strip() for ln in
               open("/proc/cpuinfo") if ln.startswith("model name")), ""), "timing": [], "identity": []}
        # --- timing: one call of B rows vs B calls of one row, at cache length pos
        for B in batches:
            cb = Caller(batched, man, B)
            c1 = Caller(one, man, 1)
            x = (rng.standard_normal((B, hidden)) * 0.02).astype(np.float32)
            lens = [a.pos] * B
            for _ in range(3):
                cb(x, lens)
                c1(x[:1], lens[:1])
            tb, t1 = [], []
            for _ in range(a.reps):
                t = time.perf_counter(); cb(x, lens); tb.append(time.perf_counter() - t)
                t = time.perf_counter()
                for b in range(B):
                    c1(x[b : b + 1], lens[:1])
                t1.append(time.perf_counter() - t)
            r = {"B": B, "batched_ms": 1000 * statistics.median(tb), "batched_min_ms": 1000 * min(tb),
                 "one_row_calls_ms": 1000 * statistics.median(t1), "one_row_calls_min_ms": 1000 * min(t1)}
            r["speedup"] = r["one_row_calls_ms"] / r["batched_ms"]
            res["timing"].append(r)
            print(json.dumps(r), file=sys.stderr)
        # --- identity: teacher-forced decode, batched vs alone
        e = vlm.row
        for B in batches:
            if B == 1:
                continue
            cb = Caller(batched, man, B)
            ref_logits, ref_tokens, lengths, first = [], [], [], []
            for b in range(B):
                ids = vlm.bundle.tokenizer.encode(PROMPTS[b % len(PROMPTS)]).ids
                logits = e.prefill(e.embed(ids), "hybrid").copy()
                for j, buf in enumerate(cb.cache):  # the prefilled rows into row b of the batched buffers
                    src = (e.cache.keys if j % 2 == 0 else e.cache.values)[j // 2]
                    buf[b] = src[0]
                tok = int(np.argmax(logits))
                seq_l, seq_t = [], [tok]
                for _ in range(a.steps):
                    seq_l.append(e.step_token(seq_t[-1]).copy())
                    seq_t.append(int(np.argmax(seq_l[-1])))
                ref_logits.append(np.stack(seq_l))
                ref_tokens.append(seq_t)
                lengths.append(len(ids))
            maxdiff, first_diff, identical = 0.0, None, True
            for s in range(a.steps):
                x = np.stack([e.embed([ref_tokens[b][s]])[0] for b in range(B)])
                out = cb(x, [lengths[b] + s for b in range(B)])
                d = np.abs(out - np.stack([ref_logits[b][s] for b in range(B)]))
                maxdiff = max(maxdiff, float(d.max()))
                identical &= bool((d == 0).all())
                am = out.argmax(1)
                if first_diff is None and any(am[b] != ref_tokens[b][s + 1] for b in range(B)):
                    first_diff = s
            r = {"B": B, "bit_identical": identical, "max_abs_logit_diff": maxdiff, "first_argmax_diff_step": first_diff,
                 "steps": a.steps}
            res["identity"].append(r)
            print(json.dumps(r), file=sys.stderr)
        print(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
