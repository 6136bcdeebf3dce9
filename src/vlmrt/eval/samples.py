"""The built-in evaluation and calibration samples: (image or None, prompt) pairs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

IMAGE_PROMPTS = ["Describe this image in detail."]
TEXT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a neural network is to a ten-year-old.",
    "List three uses of a paperclip.",
]

# GPTQ's calibration prompts (--quant w4a8g / w4a16g, export/cpu/calibrate_gptq.py): apart from TEXT_PROMPTS and from
# benchmarks/quant_accuracy.py's HELD_OUT, so that neither evaluation set is one the weights were fitted on.
CALIBRATION_PROMPTS = [
    "What is photosynthesis?",
    "Write a haiku about autumn leaves.",
    "Explain how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe a busy city street at night.",
    "What are the benefits of regular exercise?",
    "Tell me a short story about a dragon who loves books.",
    "How does the internet work, in simple terms?",
    "List five countries in South America.",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to lunch.",
    "Explain the rules of chess briefly.",
    "What causes earthquakes?",
    "Suggest three names for a coffee shop.",
    "How do vaccines protect us from disease?",
]


def sample_images() -> list[Path]:
    d = resources.files("vlmrt") / "data"
    return sorted(Path(str(p)) for p in d.iterdir() if p.name.endswith((".png", ".jpg")))


def default_samples(text_only: bool = False) -> list[tuple[Path | None, str]]:
    out: list[tuple[Path | None, str]] = [(None, p) for p in TEXT_PROMPTS]
    if not text_only:
        out += [(img, p) for img in sample_images() for p in IMAGE_PROMPTS]
    return out


def htp_calibration_samples() -> list[tuple[Path | None, str]]:
    """The HTP target's default activation calibration (`vlmrt export --target htp` without --calibration):
    CALIBRATION_PROMPTS text-only, apart from both evaluation sets (TEXT_PROMPTS, benchmarks' HELD_OUT), plus the
    sample images with IMAGE_PROMPTS (the vision graph needs images). Calibrating on TEXT_PROMPTS themselves made
    the built-in evaluation a self-test: on the real SmolLM2 decoder 1353 of its 2076 16-bit activation ranges were
    exceeded on the held-out prompts (docs/npu-deploy.md §5b)."""
    return [(None, p) for p in CALIBRATION_PROMPTS] + [(img, p) for img in sample_images() for p in IMAGE_PROMPTS]


def calibration_set(folder: str | Path) -> list[tuple[Path | None, str]]:
    """Images of a folder × its prompts.txt (one per line; default prompts otherwise), plus text-only prompts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"calibration folder not found: {folder}")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp"))
    pf = folder / "prompts.txt"
    prompts = [ln.strip() for ln in pf.read_text().splitlines() if ln.strip()] if pf.is_file() else IMAGE_PROMPTS
    if not images:
        raise ValueError(f"no images in calibration folder {folder}")
    return [(img, p) for img in images for p in prompts] + [(None, p) for p in prompts]
