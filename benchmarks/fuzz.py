"""The long run of the property-based fuzzing in tests/fuzz_targets.py: the manifest loader, the image loader, the video
reader and the server's media-folder paths, each for --minutes, in rounds of fresh random seeds (hypothesis), counting the cases tried and the failures (a failure: any
exception other than vlmrt's own BundleError / ImageError / VideoError / 400, or an accepted input that breaks the rules). Prints one
JSON object; the figure goes in docs/limits.md.

    .venv/bin/python -m benchmarks.fuzz --minutes 5           # 5 min per loader (20 min in all)
    .venv/bin/python -m benchmarks.fuzz --bundle BUNDLE ...    # fuzz around BUNDLE's manifest (default: the demo model)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(name: str, make, seconds: float, rounds_of: int) -> dict:
    counter, failures, rounds = [0], [], 0
    rng = random.Random()
    end = time.time() + seconds
    while time.time() < end:
        seed = rng.getrandbits(32)
        rounds += 1
        try:
            make(counter, seed, rounds_of)()
        except Exception as e:  # hypothesis re-raises the (shrunk) failing case's error
            failures.append({"seed": seed, "error": f"{type(e).__name__}: {str(e)[:300]}",
                             "where": traceback.format_exc().strip().splitlines()[-3:]})
    return {"loader": name, "cases": counter[0], "rounds": rounds, "failures": len(failures), "failed": failures[:10]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0, help="per loader (default 5)")
    ap.add_argument("--bundle", default=None, help="bundle whose manifest is mutated (default: the offline demo model)")
    ap.add_argument("--examples-per-round", type=int, default=500)
    a = ap.parse_args()

    from fuzz_targets import (hostile_media, image_property, manifest_property, media_path_property, prepare_bundle_copy,
                              scratch, video_property)

    if a.bundle:
        bundle = Path(a.bundle)
    else:
        os.environ.setdefault("VLMRT_CACHE", "/tmp/vlmrt-fuzz-cache")
        from vlmrt.demo.default_model import ensure_bundle

        bundle = ensure_bundle(progress=True)
    base = json.loads((bundle / "manifest.json").read_text())
    root = scratch()
    try:
        folder = prepare_bundle_copy(bundle, root / "bundle")
        results = [
            run("manifest (vlmrt.format.manifest.load, verify=True)",
                lambda c, s, n: manifest_property(base, folder, n, counter=c, seed=s), a.minutes * 60, a.examples_per_round),
            run("image (vlmrt.runtime.media.image.load_image)",
                lambda c, s, n: image_property(root, n, counter=c, seed=s), a.minutes * 60, a.examples_per_round),
            run("video (vlmrt.runtime.media.video.read_video on bytes)",
                lambda c, s, n: video_property(n, counter=c, seed=s), a.minutes * 60, a.examples_per_round),
        ]
        (root / "paths").mkdir()
        media = hostile_media(root / "paths")
        results.append(run("media-folder path (vlmrt.serve.media._read_local)",
                           lambda c, s, n: media_path_property(media, n, counter=c, seed=s), a.minutes * 60,
                           a.examples_per_round))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import hypothesis

    print(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu_model(),
                      "minutes_per_loader": a.minutes, "hypothesis": hypothesis.__version__, "bundle": str(bundle),
                      "results": results}, indent=1))
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
