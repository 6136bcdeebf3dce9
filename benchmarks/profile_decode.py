"""Where a decoder step's time goes: ORT's own per-node profile of one graph, by op type, and the host share.

    python -m benchmarks.profile_decode BUNDLE [BUNDLE ...] [--graph decode|prefill] [--pos 300] [--steps 30] [--threads 2]

For each bundle: the graph's node count after ORT's optimizations, ms per call, and the op types that take the
time (ORT's profiler: kernel time per node, summed per op type). Then a full generation through the runtime
(256-token text prompt, 64 tokens) gives the host (Python) time per decode step outside the graph call.
For the Python side itself: py-spy record -o prof.svg -- python -m vlmrt.cli bench BUNDLE (pip install py-spy).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import numpy as np



def profile_graph(bundle: Path, graph: str, pos: int, steps: int, threads: int) -> dict:
    import onnxruntime as ort

    from vlmrt.format import manifest as mf
    from vlmrt.runtime.weights import SharedWeights
    from vlmrt.runtime.decode.decoder_kinds import decoder_kind
    from vlmrt.runtime.decode.kv_cache import KVCache
    from vlmrt.runtime.decode.step import PlainStep

    m = mf.load(bundle, verify=False)
    g = m.graphs[graph]
    shared = SharedWeights(bundle)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    for k, v in shared.initializers(g).items():
        so.add_initializer(k, v)
    if not g.prepacked:
        so.add_session_config_entry("session.disable_prepacking", "1")  # as the runtime does for shared float weights
    so.enable_profiling = True
    so.profile_file_prefix = f"/tmp/vlmrt-prof-{os.getpid()}"
    s = ort.InferenceSession(str(bundle / g.file), so, providers=["CPUExecutionProvider"])
    dec = m.decoder
    ar = 1 if graph == "decode" else dec.prefill_ar
    kind = decoder_kind(dec, m.kv)
    cache = KVCache(m.kv, kind.layout)
    # the cache the runtime binds for a step at slot pos, as its decoder kind reads it (decoder_kinds.py): the prefix
    # (symbolic "ctx") or the whole cache, with the kind's own inputs (a mask, or the step's end slot)
    ctx = kind.context(pos)
    dtype = g.input(dec.embeds_input).dtype
    # the feeds a plain step's parts give (runtime/decode/step_features.py): the kind's own inputs (a mask, or the step's end
    # slot), logit_rows (the last row's logits, as the runtime asks), token rows (a prompt block's way in: scale 0)
    step = PlainStep(s, kind, cache, ctx, ar, np.dtype(dtype), kind.logits_rows(ar))
    step.buffers.load((np.random.default_rng(0).standard_normal((ar, dec.hidden_size)) * 0.02).astype(dtype),
                      np.broadcast_to(np.arange(pos, pos + ar), (dec.positions.rows, ar)))
    feeds = {}
    for part in step.parts:
        part.feed(feeds, step, pos)
    # bound as the runtime binds them: gqa_in_place, each present KV output is its past buffer (the graph writes the
    # step's rows there; a plain run() would copy the whole buffer into a new present every call)
    io, keep = s.io_binding(), []
    for name, arr in feeds.items():
        keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
        io.bind_ortvalue_input(name, keep[-1])
    present = dict(zip(cache.output_names(), cache.feeds().values())) if kind.layout.in_place else {}
    for o in s.get_outputs():
        if o.name in present:
            keep.append(ort.OrtValue.ortvalue_from_numpy(present[o.name]))
            io.bind_ortvalue_output(o.name, keep[-1])
        else:
            io.bind_output(o.name)
    for _ in range(3):
        s.run_with_iobinding(io)
    t = time.perf_counter()
    for _ in range(steps):
        s.run_with_iobinding(io)
    wall = (time.perf_counter() - t) / steps
    events = json.load(open(s.end_profiling()))
    tot, cnt, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            tot[e["args"]["op_name"]] += e["dur"]
            cnt[e["args"]["op_name"]] += 1
            by_node[e["name"][: -len("_kernel_time")]] += e["dur"]
    calls = steps + 3
    node_ms = sum(tot.values()) / 1000 / calls
    return {"bundle": str(bundle), "graph": graph, "ms_per_call": 1000 * wall, "node_ms_per_call": node_ms,
            "nodes": sum(cnt.values()) // calls,
            "ops": [(op, d / 1000 / calls, cnt[op] // calls) for op, d in tot.most_common()],
            "nodes_top": [(n, d / 1000 / calls) for n, d in by_node.most_common(3)]}


def host_overhead(bundle: Path, threads: int) -> dict:
    from vlmrt.bench import make_prompt
    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(bundle, threads=threads, verify=False)
    r = vlm(make_prompt(vlm, None, 256), None, max_new_tokens=64, ignore_eos=True)
    g = vlm.scheduler.last
    return {"decode_tokens_per_s": g.decode_tokens_per_s, "host_ms_per_step": g.host_overhead_ms_per_step,
            "ttft_s": r.stats.ttft_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--graph", default="decode")
    ap.add_argument("--pos", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    for b in a.bundles:
        p = profile_graph(Path(b), a.graph, a.pos, a.steps, a.threads)
        h = host_overhead(Path(b), a.threads)
        print(f"\n{b} [{a.graph}]: {p['nodes']} nodes, {p['ms_per_call']:.2f} ms/call (kernels {p['node_ms_per_call']:.2f} ms); "
              f"generation: {h['decode_tokens_per_s']:.1f} tok/s, host {h['host_ms_per_step']:.3f} ms/step")
        for op, ms, n in p["ops"][: a.top]:
            print(f"  {op:32s} {ms:7.2f} ms {n:5d} nodes {100 * ms / p['node_ms_per_call']:5.1f} %")
        print("  slowest nodes: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in p["nodes_top"]))


if __name__ == "__main__":
    main()
