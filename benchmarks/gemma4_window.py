"""What the windowed cache (kv.layers kind windowed_attention, docs/gemma4.md) buys Gemma 4's sliding layers on the
CPU: one random checkpoint at the E2B attention shape (hidden 512, 8 heads of 256, one KV head, window 512, 4 sliding
layers and a full one, per-layer inputs 64: benchmarks/gemma4_attention_shape.py), exported with prefill blocks of
64 and a context of 4608, its sliding layers' rows by slot (a bundle exported by a vlmrt before the windowed kind)
or in a windowed cache of window + slack rows. Timed through the runtime's own CacheRow: a random prompt of 1000 /
4000 rows (hybrid), then 32 decode steps (the median); the cache's bytes there: allocated (KVCache.nbytes: the
buffers, by slot max_context rows, and a windowed cache's snapshots) and the sliding layers' (by slot: the rows
written so far, one per slot; windowed: the buffers and the snapshots kept); the last id (the same weights: the same
ids whatever the cache).

    python -m benchmarks.gemma4_window build DIR                  # DIR/ckpt: the checkpoint
    python -m benchmarks.gemma4_window export DIR --slack 64 ...  # DIR/windowed-<slack>.bundle with this vlmrt
    python -m benchmarks.gemma4_window export DIR --kv-cache int8 # DIR/windowed-64-int8.bundle: the 8-bit cache
    python -m benchmarks.gemma4_window export DIR --kv-cache int8 --float-windows   # ...-int8-full.bundle: int8
                                                                  # on the full layer only, the windows float
    python -m benchmarks.gemma4_window time BUNDLE...             # decode step and cache bytes at 1000 / 4000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

POSITIONS, STEPS, AR, CONTEXT = (1000, 4000), 32, 64, 4608


def build(d: Path) -> None:
    from benchmarks.gemma4_attention_shape import make_checkpoint

    make_checkpoint(d / "ckpt", max_position_embeddings=8192)


def export(d: Path, slacks: list[int], kv_cache: str = "fp32", float_windows: bool = False) -> None:
    """float_windows (with kv_cache int8): the export's windowed layers keep a float cache, the full layer int8 (what
    the 8-bit windows buy, measured against it)."""
    import dataclasses

    from vlmrt.export import graphs, pipeline
    from vlmrt.format import manifest as mf

    capacity, kv_quant = graphs.window_capacity, pipeline._kv_quant
    if float_windows:
        pipeline._kv_quant = lambda *a: [dataclasses.replace(x, quant=None) if isinstance(x, mf.WindowedAttentionLayer)
                                         else x for x in kv_quant(*a)]
    tail = "" if kv_cache == "fp32" else f"-{kv_cache}" + ("-full" if float_windows else "")
    for slack in slacks:  # (the exporter's capacity is window + the prefill block: here window + slack)
        graphs.window_capacity = lambda dec, attention, ar, slack=slack: capacity(dec, attention, ar) - ar + slack
        pipeline.export(str(d / "ckpt"), d / f"windowed-{slack}{tail}.bundle", prefill_ar=AR, max_seq_len=CONTEXT,
                        progress=False, kv_cache=kv_cache)
    graphs.window_capacity, pipeline._kv_quant = capacity, kv_quant


def time_bundles(bundles: list[Path]) -> None:
    from vlmrt.runtime.vlm import VLM

    for b in bundles:
        kv = json.loads((b / "manifest.json").read_text())["kv"]
        sliding = [x for x in kv["layers"] if x["kind"] in ("sliding_attention", "windowed_attention")]
        row_bytes = sum(2 * x["kv_heads"] * x["head_dim"] * (1 if x.get("quant") else 4)  # K and V of one slot
                        for x in sliding)
        capacity = sliding[0].get("capacity")
        row = VLM.load(b).row
        rng = np.random.default_rng(0)
        for n in POSITIONS:
            embeds = (rng.standard_normal((n, row.dec.hidden_size)) * 0.5).astype(np.float32)
            t = time.perf_counter()
            logits = row.prefill(embeds, "hybrid")
            prefill = time.perf_counter() - t
            token, steps = int(np.argmax(logits)), []
            for _ in range(STEPS):
                t = time.perf_counter()
                token = int(np.argmax(row.step_token(token)))
                steps.append(time.perf_counter() - t)
            state = row.cache.states.get("windowed_attention")
            held = (f"windowed: buffers {sum(x.nbytes for x in state.buffers) / 2**20:.1f} MiB (capacity {capacity}) + "
                    f"{len(state.snapshots)} snapshots {(state.nbytes - sum(x.nbytes for x in state.buffers)) / 2**20:.1f}"
                    f" MiB" if state else f"by slot: {row_bytes * n / 2**20:.1f} MiB of rows written")
            print(f"{b.name:20s} position {n}: decode step {statistics.median(steps) * 1e3:6.2f} ms (median of "
                  f"{STEPS}), prefill {prefill:5.2f} s; cache allocated {row.cache.nbytes / 2**20:5.1f} MiB, sliding "
                  f"layers {held}; last id {token}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemma4_window")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build").add_argument("dir", type=Path)
    e = sub.add_parser("export")
    e.add_argument("dir", type=Path)
    e.add_argument("--slack", type=int, nargs="+", default=[AR])
    e.add_argument("--kv-cache", default="fp32", choices=("fp32", "int8"))
    e.add_argument("--float-windows", action="store_true")
    sub.add_parser("time").add_argument("bundles", type=Path, nargs="+")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.dir)
    elif a.cmd == "export":
        export(a.dir, a.slack, a.kv_cache, a.float_windows)
    else:
        time_bundles(a.bundles)


if __name__ == "__main__":
    main()
