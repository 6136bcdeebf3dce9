"""Where one decode step's time goes, through the runtime's own path: the scheduler's round (Scheduler.step) vs its
graph call (session.run_with_iobinding) vs the host around it, at a cache length.

    python -m benchmarks.decode_split BUNDLE --pos 128 [--steps 60] [--threads 2] [--profile] [--cprofile]

The bundle is loaded as `vlmrt run` loads it (VLM.load), a prompt of --pos tokens prefilled, 3 steps to warm up, then
--steps decode rounds of one greedy sequence: medians (and mins) of the whole round, of its graph call, and of the rest
(host: the round's bookkeeping, the token's row read, the argmax read, the stop checks). --profile: the session is
built with ORT's profiler on (which about doubles a call's time: shares only), kernel time per op type and of the
MatMulNBits nodes by output width; --cprofile: the Python functions of the timed rounds (cProfile, by own time).
Run each variant in its own process: several sessions in one process each keep a pool of spinning threads, and
whichever runs pays for the others' spinning.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()

    from vlmrt.runtime.decode.sequence import Sequence  # (vlmrt before onnxruntime: it turns ORT's telemetry off)
    from vlmrt.runtime.vlm import VLM

    import onnxruntime as ort

    if a.profile:
        class Profiled(ort.SessionOptions):
            def __init__(self):
                super().__init__()
                self.enable_profiling = True
                self.profile_file_prefix = f"/tmp/vlmrt-split-{os.getpid()}"

        ort.SessionOptions = Profiled  # (runtime/sessions.py builds its options from ort.SessionOptions)

    vlm = VLM.load(a.bundle, threads=a.threads, verify=False)
    s = vlm.scheduler
    seq = s.add(Sequence(s.embed([1000 + (i * 7) % 20000 for i in range(a.pos)]), "hybrid", a.steps + 10,
                         ignore_eos=True))
    while seq.prefilling:
        s.step()
    for _ in range(3):
        s.step()
    prof = cProfile.Profile() if a.cprofile else None
    whole, run = [], []
    for _ in range(a.steps):
        r0 = s.run_s
        t = time.perf_counter()
        if prof:
            prof.enable()
        s.step()
        if prof:
            prof.disable()
        whole.append(time.perf_counter() - t)
        run.append(s.run_s - r0)
    ms = lambda xs: f"{1000 * statistics.median(xs):.3f} (min {1000 * min(xs):.3f})"  # noqa: E731
    print(f"{a.bundle} at {a.pos}: round {ms(whole)} ms, graph call {ms(run)} ms, "
          f"host {ms([w - r for w, r in zip(whole, run)])} ms")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(10)
        print(out.getvalue())
    if a.profile:
        f = s.sessions.decode.end_profiling()
        events = json.load(open(f))
        os.remove(f)
        runs = [e for e in events if e.get("name") == "model_run"][-a.steps:]
        nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                 and e["ts"] >= runs[0]["ts"]]
        by_op, count, by_width = collections.Counter(), collections.Counter(), collections.Counter()
        for e in nodes:
            op = e["args"]["op_name"]
            by_op[op] += e["dur"]
            count[op] += 1
            if op == "MatMulNBits":
                by_width[str(list(e["args"]["output_type_shape"][0].values())[0][-1])] += e["dur"]
        kernels = sum(by_op.values()) / a.steps / 1000
        print(f"  profiled: call {statistics.median(e['dur'] for e in runs) / 1000:.3f} ms, kernels {kernels:.3f} ms, "
              f"{len(nodes) // a.steps} nodes")
        for op, d in by_op.most_common(8):
            print(f"  {op:32s} {d / a.steps / 1000:7.3f} ms {count[op] // a.steps:4d} nodes "
                  f"{100 * d / a.steps / 1000 / kernels:5.1f} %")
        for width, d in by_width.most_common():
            print(f"    MatMulNBits to {width:>6s} columns {d / a.steps / 1000:7.3f} ms")


if __name__ == "__main__":
    main()
