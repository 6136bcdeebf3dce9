"""Whole-process time and peak RSS of a short answer, `vlmrt run BUNDLE --prompt ... --max-new-tokens 64
--ignore-eos`, for one or more vlmrt source trees side by side (rounds interleaved, one warm-up run each first:
page cache, the verification record). Medians (min / max) of wall time and of the child's peak RSS.

    python benchmarks/cold_start.py BUNDLE [--src before=/path/to/old/src --src after=src] [--runs 5]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short poem about the sea."


def one(src: str, bundle: str, tokens: int) -> tuple[float, float]:
    """(wall s, peak RSS MB) of one `vlmrt run` process with src first on the path."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-c", "import sys; from vlmrt.cli import main; sys.exit(main(sys.argv[1:]))", "run", bundle,
           "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos"]
    t = time.perf_counter()
    pid = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t
    if status:
        raise SystemExit(f"{src}: vlmrt run failed ({status})")
    return wall, ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--src", action="append", help="NAME=PATH of a vlmrt src folder (default: this tree's)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    srcs = dict(s.split("=", 1) for s in a.src) if a.src else {"this": here}
    with open("/proc/loadavg") as f:
        print(f"load average at the start: {f.read().split()[0]}")
    for src in srcs.values():
        one(src, a.bundle, a.tokens)  # warm-up
    got = {n: [] for n in srcs}
    for _ in range(a.runs):
        for n, src in srcs.items():
            got[n].append(one(src, a.bundle, a.tokens))
    for n, xs in got.items():
        w, r = [x[0] for x in xs], [x[1] for x in xs]
        print(f"{n:10s} wall {statistics.median(w):.3f} s ({min(w):.3f} / {max(w):.3f})   "
              f"peak RSS {statistics.median(r):.0f} MB ({min(r):.0f} / {max(r):.0f})")


if __name__ == "__main__":
    main()
