"""Cycles per decode step that the QNN EP's HTP profiling reports, per bundle (e.g. one per --htp-arch).

    python -m benchmarks.htp_cycles BUNDLE [BUNDLE ...] [--steps 24] [--level detailed] [--out DIR]

Each bundle is opened as `vlmrt run --device htp` opens it (runtime/bundle.py Bundle.open, runtime/sessions.py make_session), except that
its decode graph's session gets two more QNN provider options, profiling_level and profiling_file_path (the QNN EP
writes a CSV of QNN's profile events, and a binary *_qnn.log for qnn-profile-viewer, when the session ends). A greedy
answer of --steps tokens (hybrid: the prompt through the prefill graph, unprofiled) runs the decode graph once per token;
per decode call the CSV holds "Accelerator (execute) time (cycles)" and "Accelerator (execute) time" (us), which are
reported here (min / median / max over the calls) next to the host's wall time of the step.

On x86-64 the HTP backend is the simulator. Its cycle counts are not a model of the device: identical calls give counts
that differ by up to 2x and more, per op too, and they follow the host's load (docs/npu-deploy.md, "Cycle counts").
On a Snapdragon the same command reads the device's counters.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import tempfile
from pathlib import Path

import numpy as np

from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.sessions import make_session
from vlmrt.runtime.vlm import VLM

PROMPT = "Describe a red square and then a blue circle on a white background, please."


def profile_events(path: Path) -> tuple[list[int], list[int]]:
    """Per graph execution: (accelerator cycles, accelerator us) from the QNN EP's profiling CSV."""
    cycles, us = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["Event Level"] != "ROOT":
                continue
            if row["Event Identifier"] == "Accelerator (execute) time (cycles)":
                cycles.append(int(row["Time"]))
            elif row["Event Identifier"] == "Accelerator (execute) time":
                us.append(int(row["Time"]))
    return cycles, us


def measure(path: Path, steps: int, level: str, out: Path) -> dict:
    b = Bundle.open(path, device="htp")
    m = b.manifest
    g = m.graphs["decode"]
    prof = out / f"{path.name}-decode.csv"
    for f in (prof, prof.with_name(prof.stem + "_qnn.log")):  # the QNN EP appends to an existing profile
        f.unlink(missing_ok=True)
    g = dataclasses.replace(g, qnn_options={**g.qnn_options, "profiling_level": level, "profiling_file_path": str(prof)})
    decode = make_session(path / (g.context.file if g.context else g.file), "htp", None, m.target, graph=g)
    sessions = {n: b.sessions[n] for n in ("prefill", "head") if n in m.graphs}
    vlm = VLM(dataclasses.replace(b, sessions={**sessions, "decode": decode}))
    r = vlm(PROMPT, None, mode="hybrid", max_new_tokens=steps + 1, ignore_eos=True)
    wall = vlm.scheduler.last.step_times  # per decode step (engine.GenerationStats)
    del vlm, decode, sessions, r
    gc.collect()  # the QNN EP writes the profile when the session ends
    cycles, us = profile_events(prof)
    if not cycles:
        raise SystemExit(f"vlmrt: error: {prof} has no 'Accelerator (execute) time (cycles)' events")

    def mmm(x) -> list[float]:
        return [float(np.min(x)), float(np.median(x)), float(np.max(x))]

    return {"bundle": str(path), "htp_arch": m.target.get("htp_arch"), "soc_name": m.target.get("soc_name"),
            "qnn_sdk": m.target.get("qnn_sdk"), "precision": g.precision, "decode_calls": len(cycles),
            "cycles": mmm(cycles), "accel_us": mmm(us),
            # a model's counts would not depend on the host's time; measured ones follow it
            "r_cycles_us": float(np.corrcoef(cycles, us)[0, 1]), "host_step_ms": mmm(1000 * np.asarray(wall)),
            "profile": str(prof)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--level", default="detailed", choices=["basic", "detailed", "optrace"])
    ap.add_argument("--out", default=None, help="folder for the profiles (default: a temporary one)")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="htp-cycles-"))
    out.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU {cpu}; load {open('/proc/loadavg').read().split()[:3]}; simulated cycles, not device timings")
    rows = []
    for p in a.bundles:
        r = measure(Path(p), a.steps, a.level, out)
        rows.append(r)
        c, u, w = r["cycles"], r["accel_us"], r["host_step_ms"]
        print(f"v{r['htp_arch']} {Path(p).name}: {r['decode_calls']} decode calls; cycles min {c[0]:,.0f} median "
              f"{c[1]:,.0f} max {c[2]:,.0f}; accelerator us median {u[1]:,.0f} (r with cycles {r['r_cycles_us']:.2f}); host step ms median "
              f"{w[1]:.1f}",
              flush=True)
    (out / "htp_cycles.json").write_text(json.dumps(rows, indent=1))
    print(f"load {open('/proc/loadavg').read().split()[:3]}; profiles and htp_cycles.json in {out}")


if __name__ == "__main__":
    main()
