"""The training curve: phase A's answer-token loss and validation, phase B's loss and test-image accuracy."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(curve: dict, path: Path, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    loss = np.array(curve["loss"])
    k = 5
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) >= k else loss
    ax.plot(curve["step"], loss, color="0.75", lw=0.8, label="answer-token CE (batch)")
    ax.plot(curve["step"][len(curve["step"]) - len(smooth):], smooth, color="C0", label=f"CE ({k}-step mean)")
    ax.set_yscale("log")
    ax.set_xlabel(f"phase A step (batch {info['batch']}): decoder LoRA + concept prompts")
    ax.set_ylabel("cross-entropy")
    a2 = ax.twinx()
    a2.plot(curve["val_step"], curve["val_acc"], "o-", color="C3", label="val exact match")
    a2.set_ylim(0, 1.02)
    a2.set_ylabel("exact match, test subset")
    ax.legend(loc="upper left", fontsize=8), a2.legend(loc="center right", fontsize=8)
    bx.plot(curve["vision_step"], curve["vision_loss"], "o-", color="C0", label="loss (batch): probe CE (+ connector error from the 2nd stage)")
    bx.set_yscale("log")
    bx.set_xlabel(f"phase B step (batch {info['phase_b_batch']}): tower + probe, then + connector from step {info['phase_b_steps']}")
    b2 = bx.twinx()
    b2.plot(curve["vision_step"], curve["vision_acc"], "s-", color="C3", label="test images: colour and shape correct")
    b2.set_ylim(0, 1.02)
    bx.legend(loc="lower left", fontsize=8), b2.legend(loc="center right", fontsize=8)
    t = info["time_s"]
    fig.suptitle(f"easy-VQA demo model: {t['total'] / 60:.1f} min on {info['threads']} CPU threads "
                 f"(A {t['phase_a'] / 60:.1f} min, B {t['phase_b'] / 60:.1f} min); final val exact match {info['final_val_exact_match']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
