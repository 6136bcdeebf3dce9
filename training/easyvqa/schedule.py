"""The learning-rate schedule of both phases."""

from __future__ import annotations

import math


def cosine(step: int, total: int, warm: int) -> float:
    """Factor on the base rate at step 1..total: linear warm-up over `warm` steps, then a cosine to 0."""
    return min(1.0, step / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 1) / total)))
