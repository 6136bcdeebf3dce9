"""Peak resident memory of whole programs measured the same way, side by side: each command in its own process under
`/usr/bin/time -f %M` (its peak RSS), the process sampled every 20 ms from /proc/PID/smaps_rollup (the anonymous / file
split at its highest sample), the commands interleaved over --rounds. Linux only.

    python -m benchmarks.process_rss [--rounds 2] NAME=COMMAND [NAME=COMMAND ...]

COMMAND runs under bash (so "$(cat PROMPT)" works), stdin closed, stdout dropped; LD_LIBRARY_PATH may be set in the
caller's environment for llama.cpp's binaries. Prints one JSON line per run: the arm, `/usr/bin/time`'s peak MB, the
highest sample's MB, anonymous and file MB there, wall seconds and the exit status (with the last lines of stderr when
it failed). docs/performance.md "vlmrt against llama-cli at 4000 tokens".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time


def rollup(pid: int) -> dict[str, int] | None:
    """Rss and Anonymous (kB) of the process, None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                p = line.split()
                if p[0] in ("Rss:", "Anonymous:"):
                    out[p[0][:-1]] = int(p[1])
    except OSError:
        return None
    return out


def child_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def run(name: str, cmd: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(["/usr/bin/time", "-f", "%M", "bash", "-c", "exec " + cmd], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    best, kid = {"Rss": 0, "Anonymous": 0}, None
    while p.poll() is None:
        kid = kid or child_of(p.pid)
        s = rollup(kid) if kid else None
        if s and s.get("Rss", 0) > best["Rss"]:
            best = s
        time.sleep(0.02)
    err = p.stderr.read().strip().splitlines()
    peak = int(err[-1]) / 1024 if err and err[-1].isdigit() else None
    return {"arm": name, "time_peak_mb": peak and round(peak, 1), "sampled_mb": round(best["Rss"] / 1024, 1),
            "anon_mb": round(best.get("Anonymous", 0) / 1024, 1),
            "file_mb": round((best["Rss"] - best.get("Anonymous", 0)) / 1024, 1),
            "wall_s": round(time.perf_counter() - t0, 1), "rc": p.returncode, "stderr": err[-4:-1] if p.returncode else []}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arms", nargs="+", help="NAME=COMMAND")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    arms = [arm.split("=", 1) for arm in a.arms]
    for r in range(a.rounds):
        for name, cmd in arms:
            print(json.dumps({"round": r, **run(name, cmd)}), flush=True)


if __name__ == "__main__":
    main()
