"""The browser runtime (vlmrt web: onnxruntime-web WASM in headless Debian Chromium) beside the Python runtime, on
one machine, interleaved run by run (the load is whatever the machine carries: say so with the figures).

    python -m benchmarks.browser_speed BUNDLE [BUNDLE ...] [--image P] [--prompt TEXT] [--gen-tokens N] [--runs R]
        [--threads T] [--ep wasm|webgpu] [--out benchmarks/results/browser-speed.json]

Per bundle: the site is written (vlmrt.web.site) and served on 127.0.0.1; load = page start to ready (first load
downloads the bundle into Cache Storage, the reload reads it from there); then R answers alternate between the
page (window.vlmrt.ask) and VLM.load(bundle, threads=T) in this process, each with the image, EOS ignored,
N tokens: TTFT (preprocess + vision + prefill) and decode tokens/s as each runtime reports them.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def median(xs):
    return round(statistics.median(xs), 3)


def measure(bundle: Path, a, work: Path) -> dict:
    from web_browser import SWIFTSHADER_WEBGPU, browser, served

    from vlmrt.runtime.vlm import VLM
    from vlmrt.web.site import write_site

    site = write_site(bundle, work / f"site-{bundle.name}", force=True, webgpu=a.ep == "webgpu")
    image = Path(a.image)
    uri = f"data:image/{'jpeg' if image.suffix == '.jpg' else 'png'};base64," + base64.b64encode(image.read_bytes()).decode()
    row = {"bundle": str(bundle), "precision": json.loads((bundle / "manifest.json").read_text())["graphs"]["decode"]["precision"],
           "threads": a.threads, "gen_tokens": a.gen_tokens, "ep": a.ep}
    t = time.perf_counter()
    vlm = VLM.load(bundle, threads=a.threads)
    row["python_load_s"] = round(time.perf_counter() - t, 3)
    extra = tuple(SWIFTSHADER_WEBGPU) if a.ep == "webgpu" else ()
    with served(site) as url, browser(work / f"profile-{bundle.name}", extra) as ctx:
        loads = []
        for _ in range(2):  # the first downloads the bundle, the second reads it from Cache Storage
            page = ctx.new_page()
            page.goto(f"{url}/?threads={a.threads}&ep={a.ep}")
            page.wait_for_function("window.vlmrt !== undefined")
            loads.append(page.evaluate("window.vlmrt.ready.then(v => ({loadMs: v.loadMs, bytes: v.bytes, threads: v.threads}))"))
            if len(loads) == 1:
                page.close()
        row["browser_load_s"] = round(loads[0]["loadMs"] / 1000, 3)
        row["browser_reload_s"] = round(loads[1]["loadMs"] / 1000, 3)
        row["browser_threads"] = loads[1]["threads"]
        row["bundle_mb"] = round(loads[0]["bytes"]["total"] / 1e6, 1)
        runs = {"browser": [], "python": []}
        for _ in range(a.runs):
            r = page.evaluate("r => window.vlmrt.ask(r)", {"images": [uri], "prompt": a.prompt,
                                                           "maxNewTokens": a.gen_tokens, "ignoreEos": True})
            runs["browser"].append((r["stats"]["ttftMs"] / 1000, r["stats"]["decodeTokensPerS"], r["tokenIds"],
                                    r["stats"]["promptTokens"]))
            p = vlm(a.prompt, image, max_new_tokens=a.gen_tokens, ignore_eos=True)
            runs["python"].append((p.stats.ttft_s, p.stats.decode_tokens_per_s, p.token_ids, p.stats.prompt_tokens))
    for k, rs in runs.items():
        row[f"{k}_ttft_s"] = median([r[0] for r in rs])
        row[f"{k}_decode_tok_s"] = median([r[1] for r in rs])
    row["prompt_tokens"] = runs["python"][0][3]
    row["same_ids"] = all(b[2] == p[2] for b, p in zip(runs["browser"], runs["python"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--image", default=str(ROOT / "src" / "vlmrt" / "demo" / "data" / "shape.png"))
    ap.add_argument("--prompt", default="What is in the image?")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ep", choices=["wasm", "webgpu"], default="wasm",
                    help="webgpu: onnxruntime-web's WebGPU build on Chromium's SwiftShader (no GPU here): correctness")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrt-browser-") as work:
        rows = [measure(Path(b), a, Path(work)) for b in a.bundles]
    print(json.dumps(rows, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                                          indent=1) + "\n")


if __name__ == "__main__":
    main()
