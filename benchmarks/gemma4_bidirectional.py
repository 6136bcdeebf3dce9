"""What Gemma 4's bidirectional vision attention (use_bidirectional_attention "vision": the decoder's span input,
docs/gemma4.md) costs the decoder: one random checkpoint at the E2B attention shape
(benchmarks/gemma4_attention_shape.py) exported twice from the same weights,
causal and with the span input, both with prefill blocks of 64. Timed through the runtime's own CacheRow.prefill /
decode_token on the same random prompt rows: 1200 rows holding one 280-row image (rows 40..319):

  causal        the causal export, blocks of 64
  spans         the bidirectional export, the image as a span (its block is rows 40..319: 280 rows)
  spans, text   the bidirectional export, no span (-1 everywhere: what a text prompt pays for the bias)
and a decode step after the prompt (median of 32).

    python -m benchmarks.gemma4_bidirectional

Static graphs (rows_static, float, CPU EP: `--attention portable --context-step 0`, the HTP target's kind), the
prefill AR 280 (the E2B image's rows: a span's block must fit one call), context 2048, hybrid mode, the same rows:

  static causal AR 64    the causal export at a smaller AR (what the image's AR costs a text prompt, for scale)
  static causal          the causal export, blocks of 280: 5 calls
  static spans           the image as a span: blocks aligned to it ([0, 40), [40, 320) the image, then 280 each): 6
  static spans, text     no span: 5 calls, the span compare in the graph only

    python -m benchmarks.gemma4_bidirectional static-export DIR     # (not timed)
    python -m benchmarks.gemma4_bidirectional static-time DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

N, IMAGE, REPEAT = 1200, (40, 320), 5
STATIC_REPEAT = 2  # (a static call reads the whole 2048-slot cache: seconds per prefill)


def _checkpoints(d: Path) -> tuple[Path, Path]:
    """(causal, bidirectional) checkpoints of the same random weights at the E2B attention shape, in d."""
    import shutil

    from benchmarks.gemma4_attention_shape import make_checkpoint

    ckpt = make_checkpoint(d / "causal", max_position_embeddings=4096)
    bidir = d / "bidir"
    shutil.copytree(ckpt, bidir)
    config = json.loads((bidir / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (bidir / "config.json").write_text(json.dumps(config))
    return ckpt, bidir


STATIC = {"static causal AR 64": ("causal", 64), "static causal": ("causal", 280), "static spans": ("bidir", 280)}


def static_export(d: Path) -> None:
    from vlmrt.export.pipeline import export

    ckpt, bidir = _checkpoints(d)
    for (src, ar) in sorted(set(STATIC.values())):
        export(str(ckpt if src == "causal" else bidir), d / f"static-{src}-{ar}.bundle", prefill_ar=ar,
               max_seq_len=2048, attention="portable", context_step=0, progress=False)


def _time_row(row, embeds: np.ndarray, spans, repeat: int) -> tuple[float, float]:
    """Median prefill time of `embeds` (after one warm-up) and median decode step of the 32 after it, in ms."""
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        logits = row.prefill(embeds, "hybrid", spans=spans)
        times.append(time.perf_counter() - t)
    steps = []
    token = int(np.argmax(logits))
    for _ in range(32):
        t = time.perf_counter()
        token = int(np.argmax(row.step_token(token)))
        steps.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3, statistics.median(steps) * 1e3


def static_time(d: Path) -> None:
    from vlmrt.runtime.decode.spans import block_end
    from vlmrt.runtime.vlm import VLM

    spans = np.full(N, -1, np.int64)
    spans[IMAGE[0]:IMAGE[1]] = 0
    cases = [(label, src, ar, spans if label == "static spans" else None) for label, (src, ar) in STATIC.items()]
    cases.append(("static spans, text", "bidir", 280, np.full(N, -1, np.int64)))
    for label, src, ar, sp in cases:
        row = VLM.load(d / f"static-{src}-{ar}.bundle").row
        embeds = (np.random.default_rng(0).standard_normal((N, row.dec.hidden_size)) * 0.5).astype(np.float32)
        prefill_ms, step_ms = _time_row(row, embeds, sp, STATIC_REPEAT)
        b, calls = 0, 0
        while b < N:  # (the blocks CacheRow.prefill cuts)
            b, calls = block_end(sp if row.dec.span_input else None, b, ar, N), calls + 1
        print(f"{label:20s} prefill of {N} rows in {calls} calls: {prefill_ms:8.1f} ms "
              f"(median of {STATIC_REPEAT}); decode step {step_ms:6.2f} ms")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("static-export", "static-time"):
        return (static_export if sys.argv[1] == "static-export" else static_time)(Path(sys.argv[2]))
    from vlmrt.export.pipeline import export
    from vlmrt.runtime.vlm import VLM

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt, bidir = _checkpoints(d)
        bundles = {name: export(str(src), d / f"{name}.bundle", prefill_ar=64, max_seq_len=2048, progress=False)
                   for name, src in (("causal", ckpt), ("bidir", bidir))}
        rng = np.random.default_rng(0)
        spans = np.full(N, -1, np.int64)
        spans[IMAGE[0]:IMAGE[1]] = 0
        for label, name, sp in (("causal", "causal", None), ("spans", "bidir", spans),
                                ("spans, text", "bidir", np.full(N, -1, np.int64))):
            row = VLM.load(bundles[name]).row
            embeds = (rng.standard_normal((N, row.dec.hidden_size)) * 0.5).astype(np.float32)
            prefill_ms, step_ms = _time_row(row, embeds, sp, REPEAT)
            print(f"{label:12s} prefill of {N} rows: {prefill_ms:8.1f} ms (median of {REPEAT}); "
                  f"decode step {step_ms:6.2f} ms")


if __name__ == "__main__":
    main()
