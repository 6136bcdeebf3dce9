"""Records/s of `vlmrt batch` for several worker x thread layouts, measured side by side on one JSONL of easy-VQA
test questions (the demo model, greedy, 8 new tokens at most), each layout a fresh `vlmrt batch` process into an
empty OUT. While each runs, the RSS of every process under it is sampled (the driver, each Ray actor, Ray's own
processes), and each actor's peak RSS is also read from its answers (stats.peak_rss_mb).

    python -m benchmarks.batch_throughput --questions 260 --layouts 1x1,1x2,2x1 --out benchmarks/results/batch-throughput

A layout WxT is W workers of T threads: W = 1 runs in process (no Ray), W > 1 on a local Ray. Without BUNDLE the
offline default model is used (built into $VLMRT_CACHE on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def questions(n: int, folder: Path) -> Path:
    from vlmrt.demo import easyvqa_data as ev

    rows = ev.select("test", n)
    p = folder / "questions.jsonl"
    p.write_text("".join(json.dumps({"id": k, "image": str(ev.image_path("test", i)), "prompt": q}) + "\n"
                         for k, (q, _, i) in enumerate(rows)))
    return p


def _tree(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                kids.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [pid], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kind(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    if "MapBatches(Answerer)" in cmd:
        return "actor"
    if "default_worker.py" in cmd or cmd.startswith("ray::"):
        return "ray worker (idle)"
    for name in ("raylet", "gcs_server", "dashboard_agent", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if name in cmd:
            return name
    return "ray (other)" if "ray" in cmd else "other"


class RssSampler(threading.Thread):
    """The largest RSS seen per process, grouped by kind, every 0.25 s until stopped."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.peak, self.kinds, self.stop = root, {}, {}, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for p in _tree(self.root):
                try:
                    rss = int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                    if self.kinds.get(p) != "actor":  # a Ray worker takes its actor's title once it is one
                        self.kinds[p] = _kind(p, self.root)
                except (OSError, IndexError, ValueError):
                    continue
                self.peak[p] = max(self.peak.get(p, 0), rss)
            self.stop.wait(0.25)

    def by_kind(self) -> dict:
        out: dict[str, list[float]] = {}
        for p, rss in self.peak.items():
            out.setdefault(self.kinds[p], []).append(round(rss / 2**20))
        return {k: sorted(v) for k, v in sorted(out.items())}


def one(layout: str, src: Path, bundle: list[str], folder: Path, batch_size: int | None = None) -> dict:
    w, t = (int(x) for x in layout.split("x"))
    out = folder / f"out-{layout}.jsonl"
    cmd = [sys.executable, "-m", "vlmrt.cli", "batch", *bundle, "--input", str(src), "--output", str(out),
           "--workers", str(w), "--threads", str(t), "--max-new-tokens", "8", "--quiet", "--json",
           *(["--batch-size", str(batch_size)] if batch_size else [])]
    load0 = os.getloadavg()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = RssSampler(p.pid)
    sampler.start()
    o, e = p.communicate()
    sampler.stop.set()
    sampler.join()
    if p.returncode != 0:
        raise SystemExit(f"{layout}: vlmrt batch failed: {e.strip()}")
    s = json.loads(o.strip().splitlines()[-1])
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    return {"layout": layout, "workers": w, "threads": t, "batch_size": batch_size, "summary": s, "loadavg_before": load0,
            "loadavg_after": os.getloadavg(), "rss_mb": sampler.by_kind(),
            "worker_peak_rss_mb": max(d["stats"]["peak_rss_mb"] for d in lines if "stats" in d),
            "worker_load_s": sorted({round(d["stats"]["load_s"], 3) for d in lines if "stats" in d})}


def table(rows: list[dict]) -> str:
    out = ["| layout | engine | records | seconds | records/s | steady records/s | first result | worker peak RSS | "
           "RSS by process (MB) | load avg (1 min) before / after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        rss = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in r["rss_mb"].items())
        out.append(f"| {r['workers']} x {r['threads']} | {s['engine']} | {s['answered'] + s['errors']} | "
                   f"{s['seconds']:.1f} | {s['records_per_s']:.2f} | {s['steady_records_per_s']:.2f} | "
                   f"{s['first_result_s']:.1f} s | {r['worker_peak_rss_mb']:.0f} MB | {rss} | "
                   f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f} |")
    return "\n".join(out)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None, help="bundle (default: the offline demo model)")
    ap.add_argument("--questions", type=int, default=260, help="easy-VQA test questions (stratified; default 260)")
    ap.add_argument("--layouts", default="1x1,1x2,2x1", help="WORKERSxTHREADS, comma-separated (default 1x1,1x2,2x1)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the layouts (interleaved)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="vlmrt batch --batch-size: records a worker answers together (default: vlmrt's)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    bundle = [a.bundle] if a.bundle else []
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        src = questions(a.questions, folder)
        if not a.bundle:  # build the default model before timing anything
            subprocess.run([sys.executable, "-c", "from vlmrt.demo.default_model import ensure_bundle; ensure_bundle()"],
                           check=True)
        rows = []
        for k in range(a.repeat):
            (folder / str(k)).mkdir()
            for layout in a.layouts.split(","):
                rows.append(one(layout, src, bundle, folder / str(k), a.batch_size))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    head = (f"`python -m benchmarks.batch_throughput {' '.join(argv if argv is not None else sys.argv[1:])}`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs: {cpu_model()}")
    md = head + "\n\n" + table(rows) + "\n"
    print(md)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"command": head, "rows": rows}, indent=1))
        Path(a.out + ".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
