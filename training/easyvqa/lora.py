"""LoRA on every linear of the decoder's last layers (merged into the weights when the demo model is assembled)."""

from __future__ import annotations

import math

import torch
from torch import nn

LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class LoRALinear(nn.Module):
    """y = base(x) + x A^T B^T; A [r, in] ~ N(0, 1/in), B [out, r] = 0 at the start."""

    def __init__(self, base: nn.Linear, r: int, g: torch.Generator):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features, generator=g) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def add_lora(text_model, r: int, first: int, g: torch.Generator) -> dict[str, LoRALinear]:
    """LoRA on every linear of decoder layers first.. (the last ones; the earlier layers stay frozen)."""
    wrapped = {}
    for i in range(first, len(text_model.layers)):
        for t in LORA_TARGETS:
            parent, attr = t.split(".")
            mod = getattr(text_model.layers[i], parent)
            m = LoRALinear(getattr(mod, attr), r, g)
            setattr(mod, attr, m)
            wrapped[f"model.text_model.layers.{i}.{t}"] = m
    return wrapped
