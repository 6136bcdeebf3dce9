"""Greedy token ids of a bundle on a fixed set of prompts and images, both modes, as JSON: run it on a bundle before
and after a change (the same checkpoint exported by each side) and compare the files to show the change kept the
answers. Usage: python -m benchmarks.greedy_ids BUNDLE OUT.json [--tokens N]"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import vlmrt

IMAGES = [None, "tests/assets/chelsea.png", "tests/assets/rocket.jpg", "tests/assets/page.png", "tests/assets/camera.png"]
PROMPTS = ["Describe the picture in detail.", "What is written here?", "hi"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    vlm = vlmrt.load(a.bundle)
    ids = {}
    for image in IMAGES:
        for prompt in PROMPTS:
            for mode in ("kv", "hybrid"):
                path = str(ROOT / image) if image else None
                r = vlm(prompt, path, mode=mode, max_new_tokens=a.tokens, ignore_eos=True)
                ids[f"{image}|{prompt}|{mode}"] = r.token_ids
    Path(a.out).write_text(json.dumps(ids, indent=0))
    print(f"{len(ids)} answers -> {a.out}")


if __name__ == "__main__":
    main()
