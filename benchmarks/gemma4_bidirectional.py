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
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

N, IMAGE, REPEAT = 1200, (40, 320), 5


def main() -> None:
    from benchmarks.gemma4_attention_shape import make_checkpoint
    from vlmrt.export.pipeline import export
    from vlmrt.runtime.vlm import VLM

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt = make_checkpoint(d / "causal", max_position_embeddings=4096)
        bidir = d / "bidir"
        import shutil

        shutil.copytree(ckpt, bidir)
        config = json.loads((bidir / "config.json").read_text())
        config["text_config"]["use_bidirectional_attention"] = "vision"
        (bidir / "config.json").write_text(json.dumps(config))
        bundles = {name: export(str(src), d / f"{name}.bundle", prefill_ar=64, max_seq_len=2048, progress=False)
                   for name, src in (("causal", ckpt), ("bidir", bidir))}
        rng = np.random.default_rng(0)
        spans = np.full(N, -1, np.int64)
        spans[IMAGE[0]:IMAGE[1]] = 0
        for label, name, sp in (("causal", "causal", None), ("spans", "bidir", spans),
                                ("spans, text", "bidir", np.full(N, -1, np.int64))):
            row = VLM.load(bundles[name]).row
            embeds = (rng.standard_normal((N, row.dec.hidden_size)) * 0.5).astype(np.float32)
            times = []
            for _ in range(REPEAT + 1):
                t = time.perf_counter()
                logits = row.prefill(embeds, "hybrid", spans=sp)
                times.append(time.perf_counter() - t)
            steps = []
            token = int(np.argmax(logits))
            for _ in range(32):
                t = time.perf_counter()
                token = int(np.argmax(row.step_token(token)))
                steps.append(time.perf_counter() - t)
            print(f"{label:12s} prefill of {N} rows: {statistics.median(times[1:]) * 1e3:8.1f} ms (median of {REPEAT}); "
                  f"decode step {statistics.median(steps) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
