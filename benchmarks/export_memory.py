"""Peak resident memory of `vlmrt export` by progress step: the export runs as a child process; /proc/<pid>/status is
sampled every 0.2 s (VmRSS, RssAnon, RssFile) and each sample is charged to the step the child's progress line names;
the kernel's peak (ru_maxrss of the child, VmHWM) is printed at the end. Linux only.

    python -m benchmarks.export_memory CHECKPOINT OUT [vlmrt export options...]   # e.g. --quant w4a8 --max-seq-len 4608

Prints one line per step (peak VmRSS, the anonymous part at that sample, the step's time), then a JSON line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time


def status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of pid in kB ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    except (OSError, ValueError):
        return {}


def main() -> None:
    ckpt, out, *opts = sys.argv[1:]
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "export", ckpt, out, *opts],
                             stderr=subprocess.PIPE, text=True, bufsize=1)
    steps: list[dict] = [{"step": "(start)", "rss": 0, "anon": 0, "file": 0, "t": 0.0}]
    log: list[str] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = status(child.pid)
            cur = steps[-1]
            if s.get("VmRSS", 0) > cur["rss"]:
                cur.update(rss=s["VmRSS"], anon=s.get("RssAnon", 0), file=s.get("RssFile", 0))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    buf = ""
    while True:
        c = child.stderr.read(1)
        if not c:
            break
        buf += c
        m = re.search(r"\[(\d+)/(\d+)\] (.*?) \.\.\.$", buf)
        if m:  # a step starts
            steps.append({"step": m.group(3)[:90], "rss": 0, "anon": 0, "file": 0, "t": time.perf_counter() - t0})
            log.append(buf)
            buf = ""
        elif c == "\n":
            log.append(buf)
            buf = ""
    _, code, usage = os.wait4(child.pid, 0)
    done.set()
    wall = time.perf_counter() - t0
    for k, s in enumerate(steps):
        end = steps[k + 1]["t"] if k + 1 < len(steps) else wall
        print(f"{s['rss'] / 2**20:6.2f} GB (anon {s['anon'] / 2**20:5.2f}, file {s['file'] / 2**20:5.2f})  "
              f"{end - s['t']:6.1f} s  {s['step']}")
    print("".join(log[-3:]).strip()[-600:])
    print(json.dumps({"exit": os.waitstatus_to_exitcode(code), "wall_s": round(wall, 1),
                      "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
                      "steps": [{**s, "rss": round(s["rss"] / 2**20, 2), "anon": round(s["anon"] / 2**20, 2),
                                 "file": round(s["file"] / 2**20, 2), "t": round(s["t"], 1)} for s in steps]}))


if __name__ == "__main__":
    main()
