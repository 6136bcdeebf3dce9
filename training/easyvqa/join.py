"""Join: phase A's LoRA and phase B's vision side in one model, scored on the stratified test questions
(teacher-forced); writes OUT/weights.safetensors (the shipped weights), OUT/training.json and OUT/curve.png."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from vlmrt.demo.smolvlm_files import VISION_PRESETS

from .lora import LORA_TARGETS, add_lora
from .plot import plot
from .prepare import PRESET, Start
from .score import evaluate


def join(a, s: Start, log, out: Path, t0: float) -> int:
    """Load phase A's LoRA and phase B's vision side, score the whole model, write weights.safetensors."""
    model, batcher, val_rows, val_images = s.model, s.batcher, s.val_rows, s.val_images
    from safetensors.torch import load_file, save_file

    lora = load_file(str(out / "lora.safetensors"))
    vis = load_file(str(out / "vision.safetensors"))
    missing = model.load_state_dict(vis, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    first = min(int(k.split(".")[3]) for k in lora)
    loras = add_lora(model.model.text_model, a.lora_rank, first, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n, m in loras.items():
            m.lora_A.copy_(lora[n + ".lora_A"]), m.lora_B.copy_(lora[n + ".lora_B"])
    model.eval()
    acc = evaluate(model, batcher, val_rows, val_images)
    log(f"final val exact match (whole model, teacher-forced, {len(val_rows)} test questions) {acc:.3f}")
    save_file({**vis, **lora}, str(out / "weights.safetensors"), metadata={"preset": PRESET, "seed": str(a.seed)})
    pa, pb = json.loads((out / "phase_a.json").read_text()), json.loads((out / "phase_b.json").read_text())
    info = {
        "preset": PRESET, "preset_config": VISION_PRESETS[PRESET], "seed": a.seed,
        "phase_a_steps": pa["steps"], "phase_a_prompts": pa["prompts"], "batch": a.batch, "phase_b_steps": pb["steps"], "phase_b_connector_steps": pb.get("connector_steps", 0), "phase_b_batch": 32,
        "lora_rank": a.lora_rank, "lora_layers": len(loras) // len(LORA_TARGETS), "lora_targets": list(LORA_TARGETS), "lr": pa.get("lr", a.lr),
        "threads": a.threads, "final_val_exact_match": acc, "phase_b_test_nearest_concept": pb["test_nearest_concept"],
        "val": f"{len(val_rows)} stratified test questions (seed 1), teacher-forced",
        "time_s": {"phase_a": pa["time_s"], "phase_b": pb["time_s"], "total": round(pa["time_s"] + pb["time_s"] + time.time() - t0, 1)},
        "torch": torch.__version__, "curve": {**pa["curve"], **pb["curve"]},
    }
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    plot(info["curve"], out / "curve.png", info)
    return 0
