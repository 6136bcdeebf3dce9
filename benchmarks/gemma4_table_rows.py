"""Gemma 4's token rows (the embedding and the per-layer rows side by side, families/gemma4/language.py) at lower
precision: greedy answers and teacher-forced logits of the tiny "shared" test checkpoint (tests/test_gemma4_decoder.py: random
weights, 6 layers, per-layer width 8) with the host table in fp32, in fp16 and quantized four ways, dequantized on
the host:

  int8-row     one symmetric scale per row over both parts (the bundle's int8 table: export/cpu/quantize.int8_rows)
  int8-2scale  one scale for the embedding part and one for the per-layer part of each row
  int4-g16     symmetric 4-bit, one scale per group of 16 values
  int4-g8      the same, groups of 8 (the per-layer width of the test checkpoint: one scale per layer's row)

    python -m benchmarks.gemma4_table_rows
Random weights say how the formats compare on rows whose parts differ in scale, not what a released checkpoint loses:
measure that on its own weights."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np


def quantize(table: np.ndarray, hidden: int, variant: str) -> np.ndarray:
    def sym(x: np.ndarray, levels: int) -> np.ndarray:
        amax = np.abs(x).max(axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / levels, 1.0).astype(np.float32)
        return (np.clip(np.rint(x / scale), -levels, levels) * scale).astype(np.float32)

    if variant == "fp16":
        return table.astype(np.float16).astype(np.float32)
    if variant == "int8-row":
        return sym(table, 127)
    if variant == "int8-2scale":
        return np.concatenate([sym(table[:, :hidden], 127), sym(table[:, hidden:], 127)], axis=1)
    group = int(variant.split("-g")[1])
    n, w = table.shape
    return sym(table.reshape(n, w // group, group), 7).reshape(n, w)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torchvision_ops

    torchvision_ops.declare()
    import test_gemma4_decoder as t

    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        model, config = t._checkpoint("shared", folder)
        ex = t.Exported(model, config, folder / "decoder.onnx")
        hidden, fp32 = ex.text.hidden, ex.table.copy()
        ref = {}
        for variant in ("fp32", "fp16", "int8-row", "int8-2scale", "int4-g16", "int4-g8"):
            ex.table = fp32 if variant == "fp32" else quantize(fp32, hidden, variant)
            sched = ex.scheduler()
            same, diff = [], []
            for i, ids in enumerate(t.PROMPTS):
                got = list(sched.generate(sched.embed(ids), mode="hybrid", max_new_tokens=t.N, ignore_eos=True))
                if variant == "fp32":
                    ref[i] = got, None
                want = ref[i][0]
                logits = sched.rows[0].score(sched.embed(ids), want)  # teacher-forced on fp32's answer
                if variant == "fp32":
                    ref[i] = want, logits
                same.append(next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), len(want)))
                diff.append(float(np.abs(logits - ref[i][1]).max()))
            err = float(np.abs(ex.table - fp32).max() / np.abs(fp32).max())
            print(f"{variant:12s} ids equal before the first difference: {same} of {t.N}; "
                  f"teacher-forced logits max |diff| {max(diff):.2e}; "
                  f"table max error / max |value| {err:.2e}")


if __name__ == "__main__":
    main()
