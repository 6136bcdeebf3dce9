"""Long prompts side by side: TTFT, decode tokens/s and peak RSS at several prompt lengths, vlmrt bundles (any
prefill block, any KV cache), llama.cpp (its f16 or q8_0 cache) and OpenVINO GenAI in one run, rounds interleaved, medians.

    python -m benchmarks.long_prompts --arm NAME=BUNDLE[@AR] ... [--env NAME=VAR=VALUE ...] [--llama NAME=CACHE ...]
        [--llama-bin DIR] [--openvino NAME=IR --ov-python PY] [--lengths 128,1024,2048,4000] [--gen-tokens 32]
        [--rounds 3] [--threads 2] [--decode-only] --out RESULT.json
    python -m benchmarks.long_prompts --report RESULT.json [RESULT.json ...]   # the medians of several runs, markdown

--arm NAME=BUNDLE@AR: the bundle with its manifest's prefill block (decoder.prefill_ar) set to AR (a copy of the
manifest beside hard links to the bundle's files, under --work, on the bundle's file system): the CPU decoder graph takes any block from 1 to its
symbolic AR, so one export serves every block (docs/performance.md "Long prompts").
--env NAME=VAR=VALUE: the arm NAME's processes run with VAR=VALUE in their environment (e.g. ORT's
ORT_GQA_DISABLE_FLASH_ATTENTION=0: a bundle on the attention kernel it ran before runtime/gqa_kernel.py chose by cache).
--llama NAME=CACHE: llama.cpp's llama-bench (from --llama-bin) on the SmolLM2 GGUF (benchmarks.compare_gguf.find_gguf)
with cache type CACHE (f16: its default, flash attention "auto"; q8_0: `-ctk q8_0 -ctv q8_0 -fa on`): TTFT = N / its prompt tokens/s (`-p N`),
decode = its tokens/s generating --gen-tokens at depth N (`-n G -d N`), whose process's peak RSS is the row's.
--openvino NAME=IR: OpenVINO GenAI's LLMPipeline (CPU, INFERENCE_NUM_THREADS = --threads) on IR, an `optimum-cli
export openvino --task text-generation-with-past` folder (benchmarks/smollm2_llama_folder.py writes the SmolLM2
checkpoint's decoder as the Llama folder it takes), run by --ov-python (or $VLMRT_OV_PYTHON: a venv of its own,
optimum-intel pins another transformers) through benchmarks/openvino_genai_arm.py: TTFT and decode from its perf
metrics (a prompt of N tokens, no chat template, --gen-tokens after it), the process's peak RSS.
--decode-only: llama.cpp's `-p N` run (its TTFT) is skipped (its `-d N` run prefills N tokens untimed either way).
vlmrt: `vlmrt bench B --prompt-tokens N --gen-tokens G --runs 1` in its own process (a cold load, TTFT of the first
call; its peak RSS). Every measurement is one process; each round runs every (length, arm), arms in a rotated order.
Run each round as its own call when a timing window is short (--rounds 1 --out R1.json, ...) and --report them
together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import compare_gguf

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("ttft_s", "decode_tokens_per_s", "peak_rss_mb")


def with_block(bundle: Path, ar: int, work: Path) -> Path:
    """A view of bundle whose manifest says prefill block ar (the files hard-linked, the manifest a copy)."""
    out = work / f"{bundle.name}@{ar}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in bundle.iterdir():
        if f.name != "manifest.json":
            os.link(f, out / f.name)  # (hard links: a bundle refuses symlinks out of its folder)
    m = json.loads((bundle / "manifest.json").read_text())
    m["decoder"]["prefill_ar"] = ar
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def vlmrt_run(bundle: Path, n: int, gen: int, threads: int, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "vlmrt.cli", "bench", str(bundle), "--prompt-tokens", str(n), "--gen-tokens", str(gen),
           "--runs", "1", "--threads", str(threads), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})
    if p.returncode != 0:
        raise RuntimeError(f"vlmrt bench {bundle} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"ttft_s": r["ttft_s"]["median"], "decode_tokens_per_s": r["decode_tokens_per_s"]["median"],
            "peak_rss_mb": r["peak_rss_mb"], "prompt_tokens": r["prompt_tokens"]}


def llama_run(binary: Path, gguf: Path, cache: str, n: int, gen: int, threads: int, decode_only: bool = False) -> dict:
    pp = None if decode_only else compare_gguf.llama_bench(binary, gguf, threads, cache, prompt=n)
    tg = compare_gguf.llama_bench(binary, gguf, threads, cache, gen=gen, depth=n)
    return {"ttft_s": n / pp["tokens_per_s"] if pp else None, "decode_tokens_per_s": tg["tokens_per_s"],
            "peak_rss_mb": tg["peak_rss_mb"], "prompt_tokens": n, "pp_peak_rss_mb": pp["peak_rss_mb"] if pp else None,
            "flash_attn": tg["flash_attn"], "cache": f"{tg['type_k']}/{tg['type_v']}"}


def openvino_run(python: str, ir: Path, n: int, gen: int, threads: int) -> dict:
    """OpenVINO GenAI's LLMPipeline on ir in its own venv's python (benchmarks/openvino_genai_arm.py), its own
    process: TTFT and decode from the pipeline's perf metrics, the process's peak RSS."""
    p = subprocess.run([python, str(ROOT / "benchmarks/openvino_genai_arm.py"), "text", str(ir), "--llm",
                        "--prompt-tokens", str(n), "--gen", str(gen), "--threads", str(threads)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"openvino_genai_arm {ir} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    run = r["runs"][0]
    return {"ttft_s": run["ttft_ms"] / 1000, "decode_tokens_per_s": run["decode_tok_s"], "peak_rss_mb": r["peak_rss_mb"],
            "prompt_tokens": run["input_tokens"], "load_s": r["load_s"]}


def measure(a) -> dict:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    arms: list[tuple[str, object]] = []
    for spec in a.arm:
        name, _, path = spec.partition("=")
        path, _, ar = path.partition("@")
        b = Path(path)
        arms.append((name, ("vlmrt", with_block(b, int(ar), work) if ar else b)))
    envs: dict[str, dict] = {}
    for spec in a.env:
        name, _, var = spec.partition("=")
        var, _, value = var.partition("=")
        if name not in dict(arms) or not var:
            raise SystemExit(f"--env {spec}: give NAME=VAR=VALUE for a --arm's NAME")
        envs.setdefault(name, {})[var] = value
    gguf = compare_gguf.find_gguf() if a.llama else None
    for spec in a.llama:
        name, _, cache = spec.partition("=")
        if cache not in compare_gguf.LLAMA_CACHES:
            raise SystemExit(f"--llama {spec}: cache {cache!r} is not one of {', '.join(compare_gguf.LLAMA_CACHES)}")
        arms.append((name, ("llama", cache)))
    for spec in a.openvino:
        name, _, ir = spec.partition("=")
        if not a.ov_python or not (Path(ir) / "openvino_model.xml").is_file():
            raise SystemExit(f"--openvino {spec}: give NAME=IR (an optimum-cli export) and --ov-python")
        arms.append((name, ("openvino", Path(ir))))
    lengths = [int(x) for x in a.lengths.split(",")]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(), "threads": a.threads,
           "gen_tokens": a.gen_tokens, "rounds": a.rounds, "lengths": lengths, "arms": [n for n, _ in arms],
           "env": envs,
           "load_before": os.getloadavg(), "runs": []}
    for rnd in range(a.rounds):
        for n in lengths:
            k = (rnd + lengths.index(n)) % len(arms)
            for name, (kind, what) in arms[k:] + arms[:k]:  # rotated: no arm always first after a length change
                try:
                    if kind == "vlmrt":
                        r = vlmrt_run(what, n, a.gen_tokens, a.threads, envs.get(name))
                    elif kind == "openvino":
                        r = openvino_run(a.ov_python, what, n, a.gen_tokens, a.threads)
                    else:
                        r = llama_run(Path(a.llama_bin) / "llama-bench", gguf, what, n, a.gen_tokens, a.threads,
                                      a.decode_only)
                except RuntimeError as e:  # (recorded; the round goes on)
                    r = {"error": str(e)}
                r.update(arm=name, length=n, round=rnd)
                res["runs"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                Path(a.out).write_text(json.dumps({**res, "load_after": os.getloadavg()}, indent=1))  # (so far)
    res["load_after"] = os.getloadavg()
    return res


def cpu_name() -> str:
    return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")


def report(results: list[dict]) -> str:
    arms = list(dict.fromkeys(a for r in results for a in r["arms"]))
    lengths = sorted({n for r in results for n in r["lengths"]})
    runs = [x for r in results for x in r["runs"] if "error" not in x]
    loads = "; ".join(f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}" for r in results)
    lines = [f"{', '.join(r['date'] for r in results)}; {results[0]['cpu']}, {results[0]['threads']} threads; "
             f"load average {loads}; medians of {sum(r['rounds'] for r in results)} rounds", ""]
    for key, label in (("ttft_s", "TTFT s"), ("decode_tokens_per_s", "decode tok/s"), ("peak_rss_mb", "peak RSS MB")):
        lines += [f"| {label} | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for arm in arms:
            cells = []
            for n in lengths:
                xs = [x[key] for x in runs if x["arm"] == arm and x["length"] == n and x[key] is not None]
                cells.append(f"{statistics.median(xs):.{3 if key == 'ttft_s' else 1}f}" if xs else "")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=BUNDLE[@AR]")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VAR=VALUE")
    ap.add_argument("--llama", action="append", default=[], metavar="NAME=CACHE")
    ap.add_argument("--openvino", action="append", default=[], metavar="NAME=IR")
    ap.add_argument("--ov-python", default=os.environ.get("VLMRT_OV_PYTHON"),
                    help="python of a venv with openvino-genai (default: $VLMRT_OV_PYTHON)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", ""), help="folder of llama.cpp's llama-bench")
    ap.add_argument("--lengths", default="128,1024,2048,4000")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-only", action="store_true", help="skip llama.cpp's -p run (its TTFT)")
    ap.add_argument("--work", default="/tmp/vlmrt-long-prompts")
    ap.add_argument("--out", help="the result JSON")
    ap.add_argument("--report", nargs="+", metavar="RESULT", help="print the medians of these results (markdown)")
    a = ap.parse_args()
    if a.report:
        print(report([json.loads(Path(p).read_text()) for p in a.report]))
        return
    if not a.out or not (a.arm or a.llama or a.openvino):
        raise SystemExit("give --out and at least one --arm, --llama or --openvino (or --report RESULT...)")
    if a.llama and not (Path(a.llama_bin) / "llama-bench").is_file():
        raise SystemExit(f"--llama needs llama-bench in --llama-bin (got {a.llama_bin!r})")
    res = measure(a)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(report([res]))


if __name__ == "__main__":
    main()
