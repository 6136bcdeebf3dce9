"""The browser runtime's ranged token table (static/table.js "ranged": one HTTP Range request per new token id) at a
released shape, in headless Debian Chromium against vlmrt web's own server on 127.0.0.1.

    python -m benchmarks.browser_table_rows [--vocab 262144] [--width 10496] [--dtype float16] [--prompt-tokens 300]
        [--decode-tokens 64] [--runs 3] [--out benchmarks/results/browser-table-rows.json]

The defaults are Gemma 4 E2B's table: 262,144 rows of 1536 + 35 × 256 values, float16 (5.50 GB). The table is a
sparse .npy file (zeros: the bytes cost no disk, the server still reads and sends every requested byte); the page
opens it ranged (the header's request), then per run reads a prompt's rows (N distinct random ids in one rows() call:
the requests in parallel, as VLM.answer does), then decode-like steps (one new id each, one after another), then
the prompt's ids again (kept rows: no request). Times are the page's (performance.now), medians over runs; the
page's JS heap (performance.memory) before and after. Loopback only: a real host adds its round trip to each
decode step's row and to the prompt's batch of requests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--width", type=int, default=1536 + 35 * 256)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32", "int8"])
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from web_browser import STATIC, browser, served

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        site = work / "site"
        site.mkdir()
        for f in ("table.js", "npy.js"):
            shutil.copyfile(STATIC / f, site / f)
        (site / "index.html").write_text("<!doctype html><title>table</title>")
        t = np.lib.format.open_memmap(site / "embed.npy", mode="w+", dtype=a.dtype, shape=(a.vocab, a.width))
        del t  # (sparse: only the header is written)
        size = (site / "embed.npy").stat().st_size
        rng = np.random.default_rng(0)
        runs = []
        for _ in range(a.runs):
            ids = rng.choice(a.vocab, a.prompt_tokens + a.decode_tokens, replace=False).tolist()
            runs.append([ids[: a.prompt_tokens], ids[a.prompt_tokens:]])
        with served(site) as url, browser(work / "profile") as ctx:
            page = ctx.new_page()
            page.goto(url + "/index.html")
            got = page.evaluate("""async ([size, runs]) => {
                const { openTable } = await import('/table.js');
                const heap = () => performance.memory ? performance.memory.usedJSHeapSize : null;
                const m = {decoder: {embedding_file: 'embed.npy', embedding_scale_file: null}, files: {'embed.npy': {bytes: size}}};
                const heap0 = heap();
                let t = performance.now();
                const table = await openTable({base: location.origin + '/', leaveOut() {}}, m, 'ranged');
                const openMs = performance.now() - t, out = [];
                for (const [prompt, decode] of runs) {
                    t = performance.now();
                    await table.rows(prompt);
                    const promptMs = performance.now() - t, steps = [];
                    for (const id of decode) { t = performance.now(); await table.rows([id]); steps.push(performance.now() - t); }
                    t = performance.now();
                    await table.rows(prompt);
                    out.push({promptMs, stepMs: steps, keptMs: performance.now() - t});
                }
                return {openMs, runs: out, requests: table.requests, bytesRead: table.bytesRead, heapBefore: heap0, heapAfter: heap()};
            }""", [size, runs])
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    row_bytes = a.width * np.dtype(a.dtype).itemsize
    result = {"vocab": a.vocab, "width": a.width, "dtype": a.dtype, "table_bytes": size, "row_bytes": row_bytes,
              "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens, "runs": a.runs,
              "open_ms": round(got["openMs"], 3),
              "prompt_ms": [round(r["promptMs"], 1) for r in got["runs"]],
              "prompt_ms_median": med([r["promptMs"] for r in got["runs"]]),
              "decode_row_ms_median": med([x for r in got["runs"] for x in r["stepMs"]]),
              "decode_row_ms_max": round(max(x for r in got["runs"] for x in r["stepMs"]), 3),
              "kept_prompt_ms_median": med([r["keptMs"] for r in got["runs"]]),
              "requests": got["requests"], "bytes_read": got["bytesRead"],
              "js_heap_before": got["heapBefore"], "js_heap_after": got["heapAfter"]}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
