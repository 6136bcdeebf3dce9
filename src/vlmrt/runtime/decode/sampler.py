"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def validate(self) -> None:
        for name, v, kind in (("temperature", self.temperature, Real), ("top_p", self.top_p, Real),
                              ("top_k", self.top_k, Integral), ("seed", self.seed, Integral)):
            if isinstance(v, bool) or not (isinstance(v, kind) or (name == "seed" and v is None)):
                # (numpy's own errors name neither the option nor the value)
                raise TypeError(f"{name} must be {'an integer' if kind is Integral else 'a number'}"
                                f"{' or None' if name == 'seed' else ''}, not {type(v).__name__}")
        if not 0 <= self.temperature < float("inf"):  # NaN too: it made every probability NaN
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError("top-k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")
        if self.seed is not None and self.seed < 0:  # numpy's "expected non-negative integer"
            raise ValueError(f"seed must be >= 0, not {self.seed}")


class Sampler:
    def __init__(self, cfg: SamplingConfig):
        cfg.validate()
        self.cfg = cfg
        # greedy draws nothing: numpy.random stays unimported (1.4 MB of code pages, ~10 ms of a cold start)
        self.rng = np.random.default_rng(cfg.seed) if cfg.temperature > 0 else None

    def __call__(self, logits: np.ndarray) -> int:
        """logits [vocab] -> token id."""
        c = self.cfg
        if c.temperature == 0:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / c.temperature
        if c.top_k and c.top_k < x.size:
            kth = np.partition(x, -c.top_k)[-c.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if c.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = cum - p[order] < c.top_p  # smallest set whose mass reaches top_p (always >= 1 token)
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))
