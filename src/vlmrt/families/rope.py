"""RoPE frequencies of the text decoders, with the scaling types of transformers' modeling_rope_utils.py that a
fixed table of cos/sin per position can hold: default, linear, llama3, yarn, and dynamic (NTK) within the
checkpoint's max_position_embeddings (where it is the default). The graphs gather the table's rows by position
(layers.CausalDecoder.rope_table), so a frequency set that changes with the sequence length (dynamic past
max_position_embeddings, longrope) cannot be exported and is refused at export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedRope(ValueError):
    pass


@dataclass(frozen=True)
class Rope:
    """A decoder's RoPE: base theta, the scaling type and its parameters (HF's rope_parameters / rope_scaling dict),
    and the checkpoint's max_position_embeddings (dynamic and the yarn / llama3 defaults read it)."""

    theta: float = 10000.0
    type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)
    max_positions: int = 2048

    @classmethod
    def from_hf(cls, t: dict[str, Any]) -> "Rope":
        """From an HF text config: transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
        params = dict(t.get("rope_scaling") or t.get("rope_parameters") or {})
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(t.get("rope_theta", params.get("rope_theta", 10000.0)))
        if kind not in TYPES:
            raise UnsupportedRope(f"RoPE scaling {kind!r} is not supported (vlmrt exports {', '.join(TYPES)})")
        if float(params.get("partial_rotary_factor", t.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise UnsupportedRope("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        if kind != "default" and not isinstance(params.get("factor"), (int, float)):
            raise UnsupportedRope(f"RoPE scaling {kind!r} needs a numeric 'factor'")
        return cls(theta, kind, params, int(t.get("max_position_embeddings") or 2048))

    def check_context(self, max_context: int) -> None:
        """Dynamic NTK changes every frequency once a sequence passes max_position_embeddings (transformers'
        dynamic_rope_update): a fixed table matches it only up to there."""
        if self.type == "dynamic" and max_context > self.max_positions:
            raise UnsupportedRope(f"dynamic RoPE scaling is exported only up to the checkpoint's max_position_embeddings "
                                  f"({self.max_positions}); pass --max-seq-len {self.max_positions} or less")

    def frequencies(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim/2], attention factor for cos/sin), as transformers computes them at init."""
        base = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
        p = self.params
        if self.type in ("default", "dynamic"):  # dynamic's init (seq_len = max_position_embeddings) is the default
            return base, 1.0
        factor = float(p["factor"])
        if self.type == "linear":
            return base / factor, 1.0
        old = p.get("original_max_position_embeddings") or self.max_positions
        if self.type == "llama3":
            low, high = old / p["low_freq_factor"], old / p["high_freq_factor"]
            wavelen = 2 * math.pi / base
            inv = torch.where(wavelen > low, base / factor, base)
            smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            smoothed = (1 - smooth) * inv / factor + smooth * inv
            medium = ~(wavelen < high) * ~(wavelen > low)
            return torch.where(medium, smoothed, inv), 1.0
        return _yarn(self.theta, head_dim, factor, old, p)


def _yarn(theta: float, dim: int, factor: float, old: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters, step for step."""
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)
