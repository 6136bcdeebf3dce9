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


def sample_images() -> list[Path]:
    d = resources.files("vlmrt") / "data"
    return sorted(Path(str(p)) for p in d.iterdir() if p.name.endswith((".png", ".jpg")))


def default_samples(text_only: bool = False) -> list[tuple[Path | None, str]]:
    out: list[tuple[Path | None, str]] = [(None, p) for p in TEXT_PROMPTS]
    if not text_only:
        out += [(img, p) for img in sample_images() for p in IMAGE_PROMPTS]
    return out


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
