"""End-to-end easy-VQA accuracy of the shipped demo model for every precision, target and mode.

    python -m benchmarks.easyvqa_accuracy [--work /tmp/vlmrt-easyvqa] [--limit 260] [--htp-sim-limit 26]

Assembles the checkpoint (vlmrt.demo.checkpoint), then scores on the same fixed stratified test
subset (vlmrt.demo.easyvqa_data.select, 20 questions per answer at 260):
  transformers fp32 on the checkpoint (greedy `generate`, the oracle; its token ids are compared with
  vlmrt fp32's, which must be identical), vlmrt fp32 / w8a16 / w4a16 / w4a16m / w4a8 / w4a8m / w4a8o / w4a16o / w4a8g (hybrid), the HTP bundle
  (--target htp, calibrated on 12 easy-VQA *train* images x 4 questions) on the CPU EP in hybrid mode
  with and without KV requantization, and on the HTP simulator (--device htp, first
  --htp-sim-limit questions of the subset; the simulator is slow). Writes WORK/results.json and
  prints the table of docs/precisions.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vlmrt.demo import easyvqa_data as ev

MAX_NEW = 8


def vlmrt_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "vlmrt.cli", *args], check=True, cwd=ROOT, env={**__import__("os").environ,
                   "PYTHONPATH": str(ROOT / "src")})


def export(ckpt: Path, out: Path, *extra: str) -> Path:
    if not (out / "manifest.json").is_file():
        t = time.time()
        vlmrt_cli("export", str(ckpt), str(out), "--max-seq-len", "128", "--force", "--quiet", *extra)
        print(f"exported {out.name} in {time.time() - t:.0f} s", flush=True)
    return out


def calibration_dir(work: Path) -> Path:
    d = work / "calibration"
    if not d.is_dir():
        d.mkdir(parents=True)
        train = ev.load_split("train")
        for i in ev.stratified_subset(train, 12, seed=7):
            shutil.copy(ev.image_path("train", train[i][2]), d / f"{train[i][2]}.png")
        (d / "prompts.txt").write_text("What color is the shape?\nwhat shape is in the image?\n"
                                       "is there a red shape?\ndoes the image not contain a circle?\n")
    return d


def score_vlmrt(bundle: Path, rows, *, mode="hybrid", device="cpu", kv_requant=True) -> dict:
    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(bundle, device=device, kv_requant=kv_requant)
    ids = []

    def answer(image, q):
        r = vlm(q, image, mode=mode, max_new_tokens=MAX_NEW)
        ids.append(r.token_ids)
        return r.text

    r = ev.score(answer, rows)
    r["token_ids"] = ids
    return r


def score_transformers(ckpt: Path, rows) -> dict:
    import torch
    from fixtures import hf_generate, hf_processor, load_hf_model
    from PIL import Image
    from tokenizers import Tokenizer

    torch.set_num_threads(2)
    model, proc = load_hf_model(ckpt), hf_processor(ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    eos = set(json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"])
    ids = []

    def answer(image, q):
        _, _, new = hf_generate(ckpt, Image.open(image).convert("RGB"), q, MAX_NEW, model=model, processor=proc)
        new = [t for t in new if t not in eos][:MAX_NEW]
        ids.append(new)
        return tok.decode(new, skip_special_tokens=True)

    r = ev.score(answer, rows)
    r["token_ids"] = ids
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/vlmrt-easyvqa")
    ap.add_argument("--limit", type=int, default=ev.DEFAULT_LIMIT)
    ap.add_argument("--htp-sim-limit", type=int, default=26)
    ap.add_argument("--skip-htp-sim", action="store_true")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    from vlmrt.demo.checkpoint import build_checkpoint

    ckpt = work / "checkpoint"
    if not (ckpt / "model.safetensors").is_file():
        build_checkpoint(ckpt, force=True, progress=True)
    rows = ev.select("test", a.limit)
    res_path = work / "results.json"
    results = json.loads(res_path.read_text()) if res_path.is_file() else {}

    def run(name, fn):
        if name not in results:
            t = time.time()
            r = fn()
            r.pop("predictions")
            results[name] = r
            res_path.write_text(json.dumps(results) + "\n")
            print(f"{name:40s} {r['accuracy']:.4f} ({r['correct']}/{r['questions']}) {time.time() - t:.0f} s", flush=True)

    # bundles are exported when a row needs them (rows already in WORK/results.json are kept, not re-run)
    htp = lambda: export(ckpt, work / "b-htp", "--target", "htp", "--keep-qdq", "--calibration", str(calibration_dir(work)))  # noqa: E731
    run("vlmrt fp32 hybrid", lambda: score_vlmrt(export(ckpt, work / "b-fp32", "--quant", "fp32"), rows))
    run("transformers fp32 (checkpoint)", lambda: score_transformers(ckpt, rows))
    for q in ("w8a16", "w4a16", "w4a16m", "w4a8", "w4a8m", "w4a8o", "w4a16o", "w4a8g"):
        run(f"vlmrt {q} hybrid", lambda q=q: score_vlmrt(export(ckpt, work / f"b-{q}", "--quant", q), rows))
    run("vlmrt htp CPU EP hybrid", lambda: score_vlmrt(htp(), rows))
    run("vlmrt htp CPU EP hybrid --no-kv-requant", lambda: score_vlmrt(htp(), rows, kv_requant=False))
    if not a.skip_htp_sim:
        sub = rows[: a.htp_sim_limit]
        run("vlmrt htp CPU EP hybrid (sim subset)", lambda: score_vlmrt(htp(), sub))
        try:
            run("vlmrt htp simulator hybrid (sim subset)", lambda: score_vlmrt(htp(), sub, device="htp"))
        except Exception as e:  # no QNN EP here: say so in the table
            print(f"HTP simulator not available: {e}", flush=True)
    hf, fp = results["transformers fp32 (checkpoint)"], results["vlmrt fp32 hybrid"]
    same = sum(x == y for x, y in zip(hf["token_ids"], fp["token_ids"]))
    results["fp32_vs_transformers_identical_answers"] = f"{same}/{len(rows)}"
    res_path.write_text(json.dumps(results) + "\n")
    print(f"\nvlmrt fp32 token ids identical to transformers on {same}/{len(rows)} questions\n")
    print("| configuration | questions | exact match | colour | shape | yes/no | Δ vs vlmrt fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        g = r["by_group"]
        f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        d = (r["accuracy"] - fp["accuracy"]) * 100
        print(f"| {name} | {r['questions']} | {r['accuracy']:.4f} | {f(g['colour'])} | {f(g['shape'])} | {f(g['yes/no'])} | {d:+.1f} pt |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
