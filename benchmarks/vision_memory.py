"""Where a Qwen-VL / Qwen3.5 vision graph's memory goes at its patch budget (issue 46 item 5): the tower alone at a
released vision shape (random init, fp32), exported with a given attention block (vision.QUERY_ROWS), then run once
on the 1024×768 photo's patches padded to the budget in a fresh process under ORT's default CPU session options or
with the arena / memory patterns off; prints one JSON line per variant: RSS after load and after the inputs are built, the peak before and after the run, the run's seconds.

    python -m benchmarks.vision_memory [--shape qwen3_5-0.8b] [--rows 4096] [--query-rows 4096,256] [--options default,no-arena,no-pattern]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the vision configs of benchmarks/released_shapes.py's checkpoints (Qwen3.5: Qwen3-VL's tower without DeepStack)
SHAPES = {
    "qwen3_5-0.8b": dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
                         deepstack_visual_indexes=[]),
    "qwen3_5-2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                       deepstack_visual_indexes=[]),
    "qwen3_vl-2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                        deepstack_visual_indexes=[5, 11, 17]),
}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def export(shape: str, rows: int, query_rows: int, path: Path) -> None:
    import torch

    from vlmrt.export.graphs import export_graph
    from vlmrt.families.qwen_vl import vision
    from vlmrt.families.qwen_vl.config import VisionConfig

    v = VisionConfig.from_hf("qwen3_vl", {**SHAPES[shape], "patch_size": 16, "num_position_embeddings": 2304})
    torch.manual_seed(0)
    tower = vision.build(v).eval()
    vision.QUERY_ROWS = query_rows
    export_graph(vision.StaticTower(tower, v), vision.example_inputs(v, rows, -1e30), vision.input_names(v),
                 vision.output_names(v), path)


def run(path: str, shape: str, rows: int, options: str) -> None:
    import numpy as np
    import onnxruntime as ort
    from PIL import Image

    from vlmrt.families.qwen_vl import vision
    from vlmrt.families.qwen_vl.config import VisionConfig
    from vlmrt.runtime.media import image_native as native
    from vlmrt.runtime.media import vision_inputs as vi

    sys.path.insert(0, str(ROOT / "tests"))
    from test_image_native import spec

    v = VisionConfig.from_hf("qwen3_vl", {**SHAPES[shape], "patch_size": 16, "num_position_embeddings": 2304})
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.enable_cpu_mem_arena = options != "no-arena"
    so.enable_mem_pattern = options != "no-pattern"
    sess = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    loaded = _rss_mb()
    photo = Image.open(ROOT / "tests/assets/chelsea.png").convert("RGB").resize((1024, 768), Image.LANCZOS)
    p = native.smart_resize_patches(photo, spec("qwen3_vl", 64 * 32 * 32, 16384 * 32 * 32, max_patches=rows))
    ops, params = vision.host_inputs(v)
    f = vi.build_feeds(p.patches, p.grid, ops, params, rows, float(np.finfo(np.float32).min))
    fed, fed_peak = _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    sess.run(None, {n: f.feeds[n] for n in vision.input_names(v)})
    print(json.dumps({"patches": len(p.patches), "rss_loaded_mb": round(loaded, 1), "rss_fed_mb": round(fed, 1),
                      "peak_before_run_mb": round(fed_peak, 1), "run_s": round(time.perf_counter() - t, 2),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


def main() -> None:
    if sys.argv[1:2] == ["_run"]:
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_5-0.8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--query-rows", default="4096,256")
    ap.add_argument("--options", default="default")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="vlmrt-vision-memory-"))
    for q in map(int, a.query_rows.split(",")):
        path = work / f"{a.shape}-{a.rows}-q{q}.onnx"
        if not path.exists():
            export(a.shape, a.rows, q, path)
        for options in a.options.split(","):
            out = subprocess.run([sys.executable, "-m", "benchmarks.vision_memory", "_run", str(path), a.shape,
                                  str(a.rows), options], check=True, capture_output=True, text=True, cwd=ROOT)
            print(json.dumps({"shape": a.shape, "rows": a.rows, "query_rows": q, "options": options,
                              **json.loads(out.stdout.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
