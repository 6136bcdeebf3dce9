"""Where a `vlmrt bench` run's peak resident memory is: its measurement in this process while a thread samples VmRSS
every 20 ms and, at each new high (+256 kB), keeps a copy of /proc/self/smaps; then the mappings of that copy, grouped
(the heap, anonymous mappings, each shared library or Python package, the bundle's files), and the largest anonymous
ones. Linux only.

    python -m benchmarks.peak_rss_map BUNDLE [--prompt-tokens 4000] [--gen-tokens 32] [--threads 2]

The peak is within one sample (20 ms) of VmHWM, which it prints beside it (the figure `vlmrt bench` reports).
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time


def vm_rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def mappings(smaps: str) -> list[dict]:
    out: list[dict] = []
    for line in smaps.splitlines():
        p = line.split()
        if not p[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            out.append({"range": p[0], "path": p[5] if len(p) > 5 else "[anon]", "rss": 0, "size": 0})
        elif p[0] in ("Rss:", "Size:"):
            out[-1][p[0][:-1].lower()] = int(p[1])
    return out


def group(path: str) -> str:
    if not path.startswith("/"):
        return path  # [heap], [anon], [stack]
    if "site-packages/" in path:
        return "python package " + path.split("site-packages/")[1].split("/")[0]
    return os.path.basename(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    peak = {"kb": 0, "smaps": "", "t": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            kb = vm_rss_kb()
            if kb > peak["kb"] + 256:
                with open("/proc/self/smaps") as f:
                    peak.update(kb=kb, smaps=f.read(), t=time.perf_counter())
            time.sleep(0.02)

    t0 = time.perf_counter()
    threading.Thread(target=sample, daemon=True).start()
    from vlmrt.bench import bench

    r = bench(a.bundle, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, runs=1, threads=a.threads)
    done.set()
    maps = mappings(peak["smaps"])
    print(f"peak VmRSS sampled {peak['kb'] / 1024:.1f} MB at {peak['t'] - t0:.1f} s; VmHWM {r['peak_rss_mb']:.1f} MB; "
          f"{r['prompt_tokens']} prompt tokens, TTFT {r['ttft_s']['median']:.2f} s")
    by = collections.Counter()
    for m in maps:
        by[group(m["path"])] += m["rss"]
    for k, kb in by.most_common():
        if kb >= 512:
            print(f"{kb / 1024:8.1f} MB  {k}")
    print("largest anonymous mappings (resident / size MB):")
    anon = sorted((m for m in maps if m["path"] in ("[anon]", "[heap]")), key=lambda m: -m["rss"])
    for m in anon[:8]:
        print(f"  {m['rss'] / 1024:8.1f} / {m['size'] / 1024:8.1f}  {m['path']} {m['range']}")


if __name__ == "__main__":
    main()
