"""Vision encode of one photo per vision-graph variant, side by side: time per image and embeddings vs fp32.

    python -m benchmarks.vision_speed CKPT BUNDLE [--image tests/assets/chelsea.png] [--work /tmp/vlmrt-vision]
        [--variants fp32,w8a8,w8a8/basic,w8a8/tiles2,...] [--rounds 3] [--threads 2] [--json OUT]

CKPT is the checkpoint BUNDLE was exported from (its tiling, patch size and I/O names are read from BUNDLE's
manifest). Each precision's vision graph is exported once into WORK with the function `vlmrt export` uses
(export/graphs.export_vision; `i8dyn` = ORT's quantize_dynamic of the fp32 graph: int8 MatMulInteger with one
activation scale per tensor). A variant is PRECISION[/OPT][/tilesN]: OPT the ORT graph optimization level
(all = the runtime's, extended, basic, none); tilesN encodes the tiles N at a time from N threads, each
session call on 1 intra-op thread (default: one tile per call on --threads intra-op threads, as the runtime
does). Rounds are interleaved; each variant's time is the whole image (every tile, as VLM.encode_image runs
them), min / median over rounds. Accuracy: cosine similarity of the image's embedding rows
[tiles * tokens, hidden] vs the fp32 variant's: of the whole flattened image, and the worst row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from vlmrt.format import manifest as mf
from vlmrt.runtime.media import image as img_ops

OPT = {"all": "ORT_ENABLE_ALL", "extended": "ORT_ENABLE_EXTENDED", "basic": "ORT_ENABLE_BASIC", "none": "ORT_DISABLE_ALL"}
DEFAULT_VARIANTS = "fp32,w8a8,w8a16,fp16,i8dyn,fp32/basic,w8a8/basic,w8a8/extended,w8a8/tiles2"


def export_graphs(ckpt: Path, precisions: set[str], work: Path) -> None:
    """WORK/<precision>.onnx for each precision not there yet."""
    todo = [p for p in sorted(precisions) if not (work / f"{p}.onnx").is_file()]
    if not todo:
        return
    import torch

    from vlmrt.export import graphs
    from vlmrt.families import family_for
    from vlmrt.families.checkpoint import Checkpoint

    c = Checkpoint.open(ckpt)
    family = family_for(c.config)
    cfg = family.config(c.config)
    torch.manual_seed(0)
    vision = family.weights(cfg, c.tensors()).vision
    for p in [p for p in todo if p != "i8dyn"] + (["i8dyn"] if "i8dyn" in todo else []):
        t = time.perf_counter()
        if p == "i8dyn":
            export_graphs(ckpt, {"fp32"}, work)
            quantize_dynamic(work / "fp32.onnx", work / "i8dyn.onnx")
        else:
            graphs.export_vision(vision, cfg.patches_per_tile, 3 * cfg.vision.patch_size**2, "fp32", p, work / f"{p}.onnx")
        print(f"exported {p} in {time.perf_counter() - t:.0f} s", flush=True)


def quantize_dynamic(src: Path, dst: Path) -> None:
    import onnx
    import logging

    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as qd

    from vlmrt.export import graphs
    from vlmrt.export.cpu import quantize

    tmp = dst.with_suffix(".matmul.onnx")
    graphs.rewrite(tmp, quantize.gemm_to_matmul(onnx.load(str(src))))
    logging.getLogger().setLevel(logging.WARNING)  # the quantizer logs every tensor at INFO
    qd(str(tmp), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], per_channel=True,
       use_external_data_format=True)


def session(path: Path, threads: int, opt: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT[opt])
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def parse_variant(v: str) -> tuple[str, str, int]:
    prec, opt, par = v.split("/")[0], "all", 1
    for part in v.split("/")[1:]:
        if part in OPT:
            opt = part
        elif part.startswith("tiles"):
            par = int(part[5:])
        else:
            raise SystemExit(f"unknown variant part {part!r} in {v!r}")
    return prec, opt, par


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--image", type=Path, default=ROOT / "tests/assets/chelsea.png")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vlmrt-vision"))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiles", type=int, default=0, help="time and compare the first N tiles only, and scale the time "
                    "to the whole image (a tile's call is its kernels' time: docs/performance.md); 0 = all")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if "fp32" not in variants:
        variants.insert(0, "fp32")
    specs = {v: parse_variant(v) for v in variants}
    a.work.mkdir(parents=True, exist_ok=True)
    export_graphs(a.ckpt, {p for p, _, _ in specs.values()}, a.work)

    m = mf.load(a.bundle, verify=False)
    tiles = img_ops.preprocess(img_ops.load_image(a.image), m.image).pixels  # [tiles, c, S, S]
    n_tiles = len(tiles)
    feeds = [{m.vision.patches_input: img_ops.unfold_patches(t, m.image.patch_size)} for t in tiles[: a.tiles or None]]
    scale = n_tiles / len(feeds)  # per-image time from the tiles timed
    out_name = m.vision.embeds_output
    sessions = {v: session(a.work / f"{p}.onnx", a.threads if par == 1 else 1, opt) for v, (p, opt, par) in specs.items()}

    def encode(v: str) -> np.ndarray:  # [tiles * tokens, hidden]
        s, par = sessions[v], specs[v][2]
        if par == 1:
            return np.concatenate([s.run([out_name], f)[0] for f in feeds])
        with ThreadPoolExecutor(par) as ex:
            return np.concatenate(list(ex.map(lambda f: s.run([out_name], f)[0], feeds)))

    for v in variants:  # warm-up: one tile
        sessions[v].run([out_name], feeds[0])
    embeds = {v: encode(v) for v in variants}
    ref = embeds["fp32"].astype(np.float64)
    times: dict[str, list[float]] = {v: [] for v in variants}
    load0 = os.getloadavg()
    for _ in range(a.rounds):
        for v in variants:
            t = time.perf_counter()
            encode(v)
            times[v].append((time.perf_counter() - t) * scale)
    load1 = os.getloadavg()
    rows = []
    base = statistics.median(times["fp32"])
    for v in variants:
        e = embeds[v].astype(np.float64)
        cos = float(np.dot(e.ravel(), ref.ravel()) / (np.linalg.norm(e) * np.linalg.norm(ref)))
        row_cos = (e * ref).sum(1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(ref, axis=1))
        med = statistics.median(times[v])
        rows.append(dict(variant=v, precision=specs[v][0], opt=specs[v][1], tiles_at_once=specs[v][2],
                         min_s=min(times[v]), median_s=med, vs_fp32=med / base, cosine=cos,
                         worst_row_cosine=float(row_cos.min()), graph_mb=graph_mb(a.work, specs[v][0])))
    print(f"{a.image.name}: {n_tiles} tiles ({len(feeds)} timed and compared), {a.threads} threads, {a.rounds} rounds; "
          f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")
    print("| variant | image encode s (min / median) | vs fp32 | cosine vs fp32 | worst row | graph MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['min_s']:.2f} / {r['median_s']:.2f} | {r['vs_fp32']:.2f}× | {r['cosine']:.6f} "
              f"| {r['worst_row_cosine']:.6f} | {r['graph_mb']:.0f} |")
    if a.json:
        a.json.write_text(json.dumps(dict(image=str(a.image), tiles=n_tiles, tiles_timed=len(feeds), threads=a.threads, rounds=a.rounds,
                                          load_start=load0[0], load_end=load1[0], rows=rows), indent=1))


def graph_mb(work: Path, prec: str) -> float:
    return sum(f.stat().st_size for f in work.glob(f"{prec}.onnx*")) / 1e6


if __name__ == "__main__":
    main()
