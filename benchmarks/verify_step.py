"""One lookahead verify call vs decode steps of a static bundle with a verify graph (`vlmrt export --target htp
--lookahead-ar K`), on the CPU EP (the QDQ graphs, a --keep-qdq export) or the HTP (--device htp; on x86-64 the
simulator, whose times are an emulator's, not a device's).

    python -m benchmarks.verify_step BUNDLE [--device cpu|htp] [--reps 50]

Times the engine's step objects (runtime/decode/cache_row.py: the bound decode step and the bound verify step, as a lookahead
run calls them) at the position after a short prompt; 3 rounds of `reps` calls each, medians.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vlmrt.runtime.vlm import VLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    v = VLM.load(a.bundle, device=a.device, lookahead=1)
    e, k = v.row, v.manifest.decoder.verify_ar
    _, embeds = v.prompt_embeds("Repeat this list exactly: apple, banana, cherry.", None)
    e.prefill(embeds, "hybrid")
    pos = e.cache.length
    decode, verify = e._step_for("decode", 1), e._step_for("verify", k, all_rows=True)
    one, block = e.embed([5]), e.embed(list(range(5, 5 + k)))

    def ms(step, x) -> float:
        out = []
        for _ in range(a.reps):
            t = time.perf_counter()
            step(x, pos)
            out.append(time.perf_counter() - t)
        return 1000 * float(np.median(out))

    ms(decode, one), ms(verify, block)  # warm-up
    rounds = [(ms(decode, one), ms(verify, block)) for _ in range(3)]
    d, w = (float(np.median([r[i] for r in rounds])) for i in (0, 1))
    print(f"{a.device}: decode step {d:.2f} ms ({k} steps {k * d:.2f} ms); one verify call (AR {k}) {w:.2f} ms "
          f"= {w / d:.2f} decode steps")


if __name__ == "__main__":
    main()
